#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import json

with open("users.json") as f:
    users = json.load(f)
names = sorted(u["name"] for u in users if u["age"] >= 18)
with open("adults.json", "w") as f:
    json.dump(names, f)
    f.write("\n")
PY

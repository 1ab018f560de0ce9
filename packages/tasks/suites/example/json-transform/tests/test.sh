#!/bin/bash
set -uo pipefail
# -I: isolated mode, so a json.py the agent planted in /workspace (the working directory) is
# not imported in place of the standard library's.
python3 -I - <<'PY'
import json
import sys

try:
    with open("adults.json") as f:
        actual = json.load(f)
except FileNotFoundError:
    sys.exit("FAIL: adults.json does not exist")
except json.JSONDecodeError as e:
    sys.exit(f"FAIL: adults.json is not valid JSON: {e}")
expected = ["Alice", "Carol", "Eve", "Trent"]
if actual != expected:
    sys.exit(f"FAIL: expected {expected}, got {actual}")
print("ok: adults.json is correct")
PY

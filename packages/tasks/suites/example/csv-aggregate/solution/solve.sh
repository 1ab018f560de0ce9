#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
from collections import defaultdict

totals = defaultdict(int)
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += int(row["amount"])
with open("totals.csv", "w", newline="") as f:
    f.write("region,total\n")
    for region in sorted(totals):
        f.write(f"{region},{totals[region]}\n")
PY

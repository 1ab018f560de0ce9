#!/bin/bash
set -euo pipefail
tr -s '[:space:]' '\n' < words.txt | grep -v '^$' | sort | uniq -c | sort -rn | head -n 3 \
  | awk '{ print $1, $2 }' > top3.txt

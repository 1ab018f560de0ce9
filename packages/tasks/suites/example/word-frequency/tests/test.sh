#!/bin/bash
set -uo pipefail
expected=$'7 apple\n5 banana\n4 cherry'
if [ ! -f top3.txt ]; then
  echo "FAIL: top3.txt does not exist"
  exit 1
fi
actual=$(sed 's/^[[:space:]]*//; s/[[:space:]]*$//' top3.txt)
if [ "$actual" != "$expected" ]; then
  printf 'FAIL: expected\n%s\ngot\n%s\n' "$expected" "$actual"
  exit 1
fi
echo "ok: top3.txt is correct"

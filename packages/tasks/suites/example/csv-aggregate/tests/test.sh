#!/bin/bash
set -uo pipefail
if [ ! -f totals.csv ]; then
  echo "FAIL: totals.csv does not exist"
  exit 1
fi
expected=$'region,total\neast,300\nnorth,400\nsouth,210\nwest,400'
actual=$(tr -d '\r' < totals.csv)
if [ "$actual" != "$expected" ]; then
  printf 'FAIL: expected\n%s\ngot\n%s\n' "$expected" "$actual"
  exit 1
fi
echo "ok: totals.csv is correct"

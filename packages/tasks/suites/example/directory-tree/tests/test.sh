#!/bin/bash
set -uo pipefail
fail=0
expected="sorted/csv/data.csv
sorted/jpg/beach.jpg
sorted/png/cat.png
sorted/png/dog.png
sorted/txt/notes.txt
sorted/txt/todo.txt"
if [ ! -d sorted ]; then
  echo "FAIL: sorted/ does not exist"
  exit 1
fi
actual=$(find sorted -type f | LC_ALL=C sort)
if [ "$actual" != "$expected" ]; then
  printf 'FAIL: expected files\n%s\ngot\n%s\n' "$expected" "$actual"
  fail=1
fi
if [ ! -d inbox ]; then
  echo "FAIL: inbox/ was removed"
  fail=1
elif [ -n "$(ls -A inbox)" ]; then
  echo "FAIL: inbox/ is not empty: $(ls -A inbox | tr '\n' ' ')"
  fail=1
fi
if [ -f sorted/csv/data.csv ] && [ "$(cat sorted/csv/data.csv)" != $'id,value\n1,42' ]; then
  echo "FAIL: sorted/csv/data.csv was changed"
  fail=1
fi
[ "$fail" = 0 ] && echo "ok: tree is sorted"
exit "$fail"

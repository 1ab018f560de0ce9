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
# No file's contents changed: byte for byte what inbox/ held.
expect_content() { # path content
  if [ -f "$1" ] && ! printf '%s' "$2" | cmp -s - "$1"; then
    echo "FAIL: $1 was changed"
    fail=1
  fi
}
expect_content sorted/csv/data.csv $'id,value\n1,42\n'
expect_content sorted/jpg/beach.jpg $'placeholder photo: the beach\n'
expect_content sorted/png/cat.png $'placeholder image: a cat\n'
expect_content sorted/png/dog.png $'placeholder image: a dog\n'
expect_content sorted/txt/notes.txt $'meeting at noon\n'
expect_content sorted/txt/todo.txt $'buy milk\n'
[ "$fail" = 0 ] && echo "ok: tree is sorted"
exit "$fail"

#!/bin/bash
set -uo pipefail
if [ ! -f hello.txt ]; then
  echo "FAIL: hello.txt does not exist"
  exit 1
fi
# Exactly that one line, byte for byte ($(cat) would drop any number of trailing newlines);
# only its own final newline may be missing.
if ! printf 'Hello, fleet!\n' | cmp -s - hello.txt && ! printf 'Hello, fleet!' | cmp -s - hello.txt; then
  echo "FAIL: hello.txt is not the one line 'Hello, fleet!'; it holds:"
  head -c 500 hello.txt | od -c | head -n 20
  exit 1
fi
echo "ok: hello.txt has the expected line"

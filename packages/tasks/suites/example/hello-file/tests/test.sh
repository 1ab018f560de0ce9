#!/bin/bash
set -uo pipefail
if [ ! -f hello.txt ]; then
  echo "FAIL: hello.txt does not exist"
  exit 1
fi
actual=$(cat hello.txt)
if [ "$actual" != "Hello, fleet!" ]; then
  echo "FAIL: hello.txt contains: $actual"
  exit 1
fi
echo "ok: hello.txt has the expected line"

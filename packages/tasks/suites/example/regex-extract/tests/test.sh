#!/bin/bash
set -uo pipefail
if [ ! -f emails.txt ]; then
  echo "FAIL: emails.txt does not exist"
  exit 1
fi
expected="alice@example.org
bob.smith@mail.example.com
carol+test@example.org
dave_99@sub.example.net
eve@example.org
frank@example.org
ops-team@example.co.uk"
actual=$(sed 's/[[:space:]]*$//' emails.txt | grep -v '^$')
if [ "$actual" != "$expected" ]; then
  printf 'FAIL: expected\n%s\ngot\n%s\n' "$expected" "$actual"
  exit 1
fi
echo "ok: 7 distinct addresses"

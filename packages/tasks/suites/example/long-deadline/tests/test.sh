#!/bin/bash
set -uo pipefail
expected="2,3,5,7,11,13,17,19,23,29,31,37,41,43,47,53,59,61,67,71,73,79,83,89,97"
if [ ! -f primes.txt ]; then
  echo "FAIL: primes.txt does not exist"
  exit 1
fi
# One per line (blank lines and spaces around a number aside): the lines, comma-separated.
actual=$(sed 's/^[[:space:]]*//; s/[[:space:]]*$//; /^$/d' primes.txt | paste -sd ,)
if [ "$actual" != "$expected" ]; then
  echo "FAIL: expected '$expected', got '$actual'"
  exit 1
fi
echo "ok: 25 primes"

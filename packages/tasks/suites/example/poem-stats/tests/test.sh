#!/bin/bash
# Partial credit: each correct key is worth 0.25. The score goes to the reward file, which the
# verifier reads instead of the exit status.
set -uo pipefail
mkdir -p /logs/verifier
passed=0
refused=0
# Exactly the four lines: any other line, or a key given twice, and none counts (which of two
# LINES= would be the answer?).
if [ -f stats.env ]; then
  keys=$(grep -c '' stats.env)
  distinct=$(grep -oE '^(LINES|WORDS|BYTES|LONGEST)=' stats.env | sort -u | wc -l)
  if [ "$keys" != 4 ] || [ "$distinct" != 4 ]; then
    echo "FAIL: stats.env must hold exactly the four lines LINES=, WORDS=, BYTES=, LONGEST= ($keys lines, $distinct of the keys)"
    refused=1
  fi
fi
check() { # key expected
  local actual=""
  if [ -f stats.env ] && [ "$refused" = 0 ]; then
    actual=$(grep -E "^$1=" stats.env | head -n 1 | cut -d= -f2- | tr -d '[:space:]')
  fi
  if [ "$actual" = "$2" ]; then
    echo "ok:   $1=$2"
    passed=$((passed + 1))
  else
    echo "FAIL: $1 expected '$2', got '$actual'"
  fi
}
check LINES 6
check WORDS 21
check BYTES 109
check LONGEST haunches
awk -v n="$passed" 'BEGIN { printf "%.2f\n", n / 4 }' > /logs/verifier/reward.txt
echo "reward: $(cat /logs/verifier/reward.txt) ($passed of 4 checks)"

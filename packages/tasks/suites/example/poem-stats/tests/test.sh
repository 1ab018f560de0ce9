#!/bin/bash
# Partial credit: each correct key is worth 0.25. The score goes to the reward file, which the
# verifier reads instead of the exit status.
set -uo pipefail
mkdir -p /logs/verifier
passed=0
check() { # key expected
  local actual=""
  if [ -f stats.env ]; then
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

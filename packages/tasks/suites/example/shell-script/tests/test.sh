#!/bin/bash
set -uo pipefail
fail=0
check() { # description, condition result
  if [ "$2" = 0 ]; then echo "ok:   $1"; else echo "FAIL: $1"; fail=1; fi
}
if [ ! -f greet.sh ]; then
  echo "FAIL: greet.sh does not exist"
  exit 1
fi
out=$(bash greet.sh Ada 2>/dev/null); code=$?
[ "$out" = "Hello, Ada!" ] && [ "$code" = 0 ]; check "greet.sh Ada prints 'Hello, Ada!' and exits 0 (got '$out', $code)" $?
out=$(bash greet.sh "Grace Hopper" 2>/dev/null)
[ "$out" = "Hello, Grace Hopper!" ]; check "a quoted name with a space (got '$out')" $?
# stderr captured directly, not through a fixed path in /tmp (the agent could have made that
# file first, and root here cannot write a file the agent owns).
err=$(bash greet.sh 2>&1 >/dev/null); code=$?
out=$(bash greet.sh 2>/dev/null)
[ "$code" = 2 ]; check "no argument exits 2 (got $code)" $?
[ -z "$out" ]; check "no argument prints nothing on stdout (got '$out')" $?
[[ "$err" == *"usage: greet.sh NAME"* ]]; check "no argument prints the usage on stderr (got '$err')" $?
# The agent's script ran as root here: whatever it wrote to the reward file is overwritten.
mkdir -p /logs/verifier && echo $((1 - fail)) > /logs/verifier/reward.txt
exit "$fail"

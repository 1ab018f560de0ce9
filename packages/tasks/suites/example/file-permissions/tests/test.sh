#!/bin/bash
# Runs as root without capabilities: it may not read secret.txt or enter private/, but stat
# works on anything in /workspace.
set -uo pipefail
fail=0
expect_mode() { # path type mode
  local actual
  if [ "$2" = dir ] && [ ! -d "$1" ]; then echo "FAIL: $1 is not a directory"; fail=1; return; fi
  if [ "$2" = file ] && [ ! -f "$1" ]; then echo "FAIL: $1 is not a file"; fail=1; return; fi
  actual=$(stat -c %a "$1")
  if [ "$actual" = "$3" ]; then echo "ok:   $1 is $3"; else echo "FAIL: $1 is $actual, expected $3"; fail=1; fi
}
expect_mode run.sh file 750
expect_mode secret.txt file 600
expect_mode notes.txt file 644
expect_mode private dir 700
# run.sh ends up unreadable to us (mode 750, owned by the agent): compare its size instead.
if [ -f run.sh ] && [ "$(stat -c %s run.sh)" != 43 ]; then
  echo "FAIL: run.sh was changed (size $(stat -c %s run.sh), expected 43)"
  fail=1
fi
exit "$fail"

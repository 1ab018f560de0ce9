#!/bin/bash
# Runs as root without capabilities: it may not read secret.txt or run.sh (the agent's, with no
# permission for others) or enter private/, but stat works on anything in /workspace.
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
# The contents must not change. run.sh (750) and secret.txt (600) end up unreadable to us: compare
# their sizes, and their modification times to the nanosecond, which any write sets (chmod does
# not): the workspace was staged in one go, so all three files share one (whole seconds). That
# catches a write, not an agent that sets the times back (`touch -r`: it owns the files).
# notes.txt (644) we can read: compare it byte for byte.
expect_unchanged() { # path size
  if [ -f "$1" ] && [ "$(stat -c %s "$1")" != "$2" ]; then
    echo "FAIL: $1 was changed (size $(stat -c %s "$1"), expected $2)"
    fail=1
  elif [ -f "$1" ] && [ "$(stat -c %.9Y "$1")" != "$(stat -c %.9Y notes.txt 2>/dev/null)" ]; then
    echo "FAIL: $1 was written to (its modification time moved)"
    fail=1
  fi
}
expect_unchanged run.sh 43
expect_unchanged secret.txt 29
if [ -f notes.txt ] && ! printf 'Remember to rotate the logs.\n' | cmp -s - notes.txt; then
  echo "FAIL: notes.txt was changed (or cannot be read, as mode 644 allows)"
  fail=1
fi
exit "$fail"

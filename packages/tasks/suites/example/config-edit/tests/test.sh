#!/bin/bash
set -uo pipefail
# A symlink to /tests/expected.conf (dangling while the agent ran, staged before we run) would
# diff clean: the file must be the agent's own edit.
if [ -L app.conf ]; then
  echo "FAIL: app.conf is a symbolic link, not the edited file"
  exit 1
fi
if [ ! -f app.conf ]; then
  echo "FAIL: app.conf does not exist"
  exit 1
fi
if ! diff -u /tests/expected.conf app.conf; then
  echo "FAIL: app.conf differs from the expected configuration (diff above)"
  exit 1
fi
echo "ok: app.conf is correct"

#!/bin/bash
set -uo pipefail
if [ ! -f app.conf ]; then
  echo "FAIL: app.conf does not exist"
  exit 1
fi
if ! diff -u /tests/expected.conf app.conf; then
  echo "FAIL: app.conf differs from the expected configuration (diff above)"
  exit 1
fi
echo "ok: app.conf is correct"

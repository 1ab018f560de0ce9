#!/bin/bash
set -euo pipefail
chmod 750 run.sh
chmod 600 secret.txt
chmod 644 notes.txt
mkdir -p private
chmod 700 private

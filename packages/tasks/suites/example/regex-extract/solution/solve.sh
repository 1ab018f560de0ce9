#!/bin/bash
set -euo pipefail
grep -oE '[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}' app-log.txt \
  | tr '[:upper:]' '[:lower:]' | LC_ALL=C sort -u > emails.txt

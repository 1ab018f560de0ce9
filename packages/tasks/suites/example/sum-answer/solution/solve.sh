#!/bin/bash
set -euo pipefail
awk '{ sum += $1 } END { print sum }' numbers.txt

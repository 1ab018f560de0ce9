#!/bin/bash
set -euo pipefail
sed 's/^v//' versions.txt | sort -V | tail -n 1

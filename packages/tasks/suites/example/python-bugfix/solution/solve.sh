#!/bin/bash
# The reference fix ships as a helper file next to this script.
set -euo pipefail
cp /solution/stats_fixed.py stats.py

#!/bin/bash
# The tests live in /tests (staged after the agent stopped); config and rootdir pinned there so
# nothing in /workspace can reconfigure pytest. The agent's code runs only in child interpreters
# (see test_stats.py); as it runs as root, whatever it wrote to the reward file is overwritten.
set -uo pipefail
export PYTHONDONTWRITEBYTECODE=1
pytest -q -c /tests/pytest.ini --rootdir=/tests /tests/test_stats.py
code=$?
mkdir -p /logs/verifier && if [ "$code" = 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
exit "$code"

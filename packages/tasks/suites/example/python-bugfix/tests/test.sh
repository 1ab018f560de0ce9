#!/bin/bash
# The tests live in /tests (staged after the agent stopped); config and rootdir pinned there so
# nothing in /workspace can reconfigure pytest.
set -uo pipefail
export PYTHONDONTWRITEBYTECODE=1
pytest -q -c /tests/pytest.ini --rootdir=/tests /tests/test_stats.py

"""Tests for /workspace/stats.py. The agent's module is only ever imported in a separate
interpreter (`call`), never in this pytest process: whatever it does on import (exit early,
patch pytest) cannot change how these tests report."""

import json
import os
import signal
import subprocess
import sys

CHILD = """
import json, sys
sys.path.insert(0, "/workspace")
import stats
args = json.loads(sys.argv[2])
try:
    print(json.dumps({"value": getattr(stats, sys.argv[1])(*args)}))
except Exception as e:
    print(json.dumps({"raised": type(e).__name__}))
"""


def call(fn, *args):
    """stats.<fn>(*args) run in a fresh interpreter: {"value": ...} or {"raised": "<Exception>"}.
    At most 30 s (a call takes well under a second; the room is for a loaded host: a timeout
    fails the test), in a session of its own that is killed when it returns: the agent's code
    runs as root, as the tests do, and nothing it starts may outlive the call (to write the
    reward file after test.sh, say)."""
    with subprocess.Popen(
        [sys.executable, "-I", "-c", CHILD, fn, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/tmp",
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=30)
        finally:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = out.strip().splitlines()
    assert child.returncode == 0 and lines, f"stats.{fn} did not run: exit {child.returncode}, {err[-500:]}"
    return json.loads(lines[-1])


def test_median_odd():
    assert call("median", [3, 1, 2]) == {"value": 2}


def test_median_even():
    assert call("median", [1, 2, 3, 4]) == {"value": 2.5}


def test_median_even_unsorted():
    assert call("median", [10, 2, 8, 4]) == {"value": 6}


def test_median_single():
    assert call("median", [7]) == {"value": 7}


def test_median_empty_raises():
    assert call("median", []) == {"raised": "ValueError"}


def test_mean_still_works():
    assert call("mean", [1, 2, 3, 4]) == {"value": 2.5}


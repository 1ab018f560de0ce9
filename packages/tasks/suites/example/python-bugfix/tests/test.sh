#!/bin/bash
# The tests live in /tests (staged after the agent stopped); config and rootdir pinned there so
# nothing in /workspace can reconfigure pytest. The agent's code runs only in child interpreters,
# each bounded in time and killed with all it started (see test_stats.py); pytest as a whole gets
# 150 s, so the reward below is always written within the tests' 180 s (room for a loaded host:
# the timeout grades 0, so it must only ever catch code that hangs).
set -uo pipefail
export PYTHONDONTWRITEBYTECODE=1
# Before the reward: kill everything started since this script (all that the agent's code
# started, however it hid: a session of its own, another name), except this script and its
# parents, in rounds until none is left. Builtins only.
reap() {
  local line p f n round mine keep=" "
  line=; read -r -d '' line 2>/dev/null < /proc/$$/stat; set -- ${line##*) }; mine=${20:-0}
  [ "$mine" -gt 0 ] 2>/dev/null || return 0 # no start time of its own: nothing is safe to kill
  p=$$
  while [ "$p" -gt 0 ] 2>/dev/null; do
    keep="$keep$p "; line=
    read -r -d '' line 2>/dev/null < /proc/$p/stat; [ -n "$line" ] || break
    set -- ${line##*) }; p=${2:-0}
  done
  for round in 1 2 3 4 5 6 7 8 9 10; do
    n=0
    for f in /proc/[0-9]*/stat; do
      p=${f#/proc/}; p=${p%/stat}
      case "$keep" in *" $p "*) continue ;; esac
      line=; read -r -d '' line 2>/dev/null < "$f"; [ -n "$line" ] || continue
      set -- ${line##*) }
      [ "${1:-}" = Z ] && continue
      [ "${20:-0}" -lt "$mine" ] 2>/dev/null && continue
      kill -9 "$p" 2>/dev/null && n=$((n + 1))
    done
    [ "$n" -eq 0 ] && break
  done
}
# The reward, last, in a /logs/verifier of our own: the agent's code ran as root, as we do, and may
# have written one and taken the write permission away, or put a directory of the agent's in its
# place. /logs is root's, so whatever is there goes aside whole. A reward we cannot write is an
# error, never the number the agent left.
write_reward() { # reward
  local d=/logs/verifier aside
  reap
  chmod u+rwx /logs 2>/dev/null
  rm -f "$d" 2>/dev/null
  if [ -e "$d" ] && aside=$(mktemp -d /logs/.verifier-aside.XXXXXX); then
    mv -T "$d" "$aside" 2>/dev/null
  fi
  if mkdir "$d" && echo "$1" > "$d/reward.txt" && [ "$(cat "$d/reward.txt")" = "$1" ]; then return 0; fi
  echo "ERROR: cannot write the reward ($1) to $d/reward.txt" >&2
  exit 3
}
# Everything after the agent's code runs is in main, and the last line calls it and exits: bash
# reads a script as it runs it, and the agent's code (root, as we are) could rewrite the rest of
# this file under us; a function is read whole before it runs, and nothing after that line is read.
main() {
  local code
  timeout -k 5 150 pytest -q -c /tests/pytest.ini --rootdir=/tests /tests/test_stats.py
  code=$?
  if [ "$code" = 0 ]; then write_reward 1; else write_reward 0; fi
  return "$code"
}
main "$@"; exit $?

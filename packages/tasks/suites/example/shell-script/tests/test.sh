#!/bin/bash
set -uo pipefail
fail=0
check() { # description, condition result
  if [ "$2" = 0 ]; then echo "ok:   $1"; else echo "FAIL: $1"; fail=1; fi
}
# The agent's script runs as root here, as we do: each run at most 10 s (a greeting takes
# milliseconds; the room is for a loaded host, where a timeout would grade working code 0), in a
# process group of its own (timeout makes one) that is killed when it returns, so nothing it
# started in the background is left to write the reward file after us.
agent() {
  timeout -k 1 10 "$@" &
  local pid=$! code
  wait "$pid"
  code=$?
  kill -KILL -- "-$pid" 2>/dev/null
  return "$code"
}
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
# The reward, last, in a /logs/verifier of our own: the agent's script may have written one and
# taken the write permission away, or put a directory of the agent's in its place. /logs is
# root's, so whatever is there goes aside whole. A reward we cannot write is an error, never the
# number the agent left.
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
# Everything that runs the agent's code is in main, and the last line calls it and exits: bash
# reads a script as it runs it, and the agent's code (root, as we are) could rewrite the rest of
# this file under us; a function is read whole before it runs, and nothing after that line is read.
main() {
  if [ ! -f greet.sh ]; then
    echo "FAIL: greet.sh does not exist"
    exit 1
  fi
  out=$(agent bash greet.sh Ada 2>/dev/null); code=$?
  [ "$out" = "Hello, Ada!" ] && [ "$code" = 0 ]; check "greet.sh Ada prints 'Hello, Ada!' and exits 0 (got '$out', $code)" $?
  out=$(agent bash greet.sh "Grace Hopper" 2>/dev/null)
  [ "$out" = "Hello, Grace Hopper!" ]; check "a quoted name with a space (got '$out')" $?
  # stderr captured directly, not through a fixed path in /tmp (the agent could have made that
  # file first, and root here cannot write a file the agent owns).
  err=$(agent bash greet.sh 2>&1 >/dev/null); code=$?
  out=$(agent bash greet.sh 2>/dev/null)
  [ "$code" = 2 ]; check "no argument exits 2 (got $code)" $?
  [ -z "$out" ]; check "no argument prints nothing on stdout (got '$out')" $?
  [[ "$err" == *"usage: greet.sh NAME"* ]]; check "no argument prints the usage on stderr (got '$err')" $?
  write_reward $((1 - fail))
  exit "$fail"
}
main "$@"; exit $?

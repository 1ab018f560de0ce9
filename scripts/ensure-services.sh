#!/usr/bin/env bash
# Bring up what the fleet's tests and demo need on this machine, idempotently:
#   - Debian packages when missing and run as root: redis-server and bubblewrap; docker.io when no
#     daemon answers; debootstrap when the base image must be built;
#   - a Docker daemon when none answers;
#   - a Redis with AOF (appendfsync always) and noeviction on 127.0.0.1:${FLEET_TEST_REDIS_PORT:-6379}
#     unless REDIS_URL is set;
#   - the offline sandbox base image.
# Prints `export` lines for what it started (eval-able); logs go to stderr. Its own state (the
# private Redis's data, dockerd's log) goes to FLEET_STATE_DIR, .fleet/ here by default.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
state="${FLEET_STATE_DIR:-$here/../.fleet}"
mkdir -p "$state"
log() { echo "[ensure-services] $*" >&2; }

# dockerd and debootstrap live in sbin, which a non-root user's PATH on Debian leaves out.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
# Asked once here (each `docker info` against a busy daemon can take a while), again only after installs.
docker_answers=0
command -v docker >/dev/null && docker info >/dev/null 2>&1 && docker_answers=1
need=()
command -v redis-server >/dev/null || need+=(redis-server)
# The daemon only when none answers (one started elsewhere, or a remote DOCKER_HOST, will do).
[ "$docker_answers" = 1 ] || command -v dockerd >/dev/null || need+=(docker.io)
# debootstrap only to build the base image, when it is not there already.
if ! command -v debootstrap >/dev/null; then
  if [ "$docker_answers" = 0 ] || ! docker image inspect "$(bash "$here/build-base-image.sh" --print-tag)" >/dev/null 2>&1; then
    need+=(debootstrap)
  fi
fi
command -v bwrap >/dev/null || need+=(bubblewrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing: ${need[*]}; run as root or: apt-get install -y ${need[*]}"; exit 1
  fi
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq "${need[@]}" >&2
fi

# Docker daemon.
if [ "$docker_answers" = 0 ] && ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then log "no Docker daemon answers and we are not root to start one"; exit 1; fi
  log "starting dockerd"
  (setsid dockerd --iptables=false --ip6tables=false >"$state/dockerd.log" 2>&1 &)
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { log "dockerd did not come up; see $state/dockerd.log"; tail -20 "$state/dockerd.log" >&2; exit 1; }
fi

# Redis (private, AOF + noeviction) unless the caller brings one.
if [ -z "${REDIS_URL:-}" ]; then
  port="${FLEET_TEST_REDIS_PORT:-6379}"
  # The fleet refuses a Redis without AOF and noeviction: one already on the port that lacks them
  # (Debian's own service, say) is left alone and a private one runs on the next port.
  durable() {
    [ "$(redis-cli -p "$1" config get appendonly 2>/dev/null | tail -1)" = yes ] &&
      [ "$(redis-cli -p "$1" config get maxmemory-policy 2>/dev/null | tail -1)" = noeviction ] &&
      [ "$(redis-cli -p "$1" config get appendfsync 2>/dev/null | tail -1)" = always ]
  }
  # One this script started before Redis had to fsync each write (its dir is ours): made durable
  # in place rather than refused (it keeps the test state of earlier runs on this machine).
  ours() { [ "$(redis-cli -p "$1" config get dir 2>/dev/null | tail -1)" = "$(cd "$state" 2>/dev/null && pwd -P)/redis" ]; }
  if redis-cli -p "$port" ping >/dev/null 2>&1 && ! durable "$port" && ours "$port"; then
    redis-cli -p "$port" config set appendfsync always >/dev/null
  fi
  if redis-cli -p "$port" ping >/dev/null 2>&1 && ! durable "$port"; then
    log "the Redis on 127.0.0.1:$port lacks AOF (appendfsync always) or noeviction; starting a private one on $((port + 1))"
    port=$((port + 1))
  fi
  if ! redis-cli -p "$port" ping >/dev/null 2>&1; then
    log "starting redis on 127.0.0.1:$port"
    mkdir -p "$state/redis"
    redis-server --bind 127.0.0.1 --port "$port" --dir "$state/redis" --appendonly yes \
      --appendfsync always --maxmemory-policy noeviction --save "" --daemonize yes --logfile "$state/redis/redis.log" >&2
    for _ in $(seq 1 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  redis-cli -p "$port" ping >/dev/null 2>&1 || { log "redis did not come up on 127.0.0.1:$port; see $state/redis/redis.log"; exit 1; }
  if ! durable "$port" && ours "$port"; then redis-cli -p "$port" config set appendfsync always >/dev/null; fi
  durable "$port" || { log "the Redis on 127.0.0.1:$port lacks AOF (appendfsync always) or noeviction"; exit 1; }
  echo "export REDIS_URL=redis://127.0.0.1:$port"
fi

# The offline sandbox image.
if [ -x "$here/build-base-image.sh" ] || [ -f "$here/build-base-image.sh" ]; then
  tag="$(bash "$here/build-base-image.sh" >&2 && bash "$here/build-base-image.sh" --print-tag)"
  echo "export FLEET_BASE_IMAGE=$tag"
fi

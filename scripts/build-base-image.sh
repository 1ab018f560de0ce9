#!/usr/bin/env bash
# Build the offline sandbox base image `rollout-fleet/base` (no image registry needed):
#   debootstrap --variant=minbase bookworm (from the Debian mirror apt is configured with here)
#   + configs/sandbox-image/packages.txt, user `agent` (1000:1000), mount points, then
#   `tar | docker import`. Tagged `rollout-fleet/base:<recipe hash>` and `rollout-fleet/base:latest`.
#
# Usage: build-base-image.sh [--print-tag] [--force]
#   --print-tag  print the hash tag and exit (builds nothing)
#   --force      rebuild even when the hash tag exists (ignores the cached rootfs too)
# Env: FLEET_STATE_DIR (default <repo>/.fleet; the rootfs cache lives in its cache/),
#      FLEET_DEBIAN_MIRROR (override the mirror read from apt's sources),
#      FLEET_DEBIAN_SUITE (default bookworm).
# Logs go to stderr. Needs root (debootstrap) unless the image or its cached rootfs exists.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
recipe_dir="$repo/configs/sandbox-image"
state="${FLEET_STATE_DIR:-$repo/.fleet}"
cache="$state/cache"
suite="${FLEET_DEBIAN_SUITE:-bookworm}"
repo_name="rollout-fleet/base"

log() { echo "[build-base-image] $*" >&2; }
die() { log "error: $*"; exit 1; }

print_tag=0
force=0
for arg in "$@"; do
  case "$arg" in
    --print-tag) print_tag=1 ;;
    --force) force=1 ;;
    -h | --help) sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $arg" ;;
  esac
done

# The recipe: this script and every file of configs/sandbox-image, in a stable order.
recipe_hash() {
  {
    echo "== build-base-image.sh"
    cat "${BASH_SOURCE[0]}"
    if [ -d "$recipe_dir" ]; then
      find "$recipe_dir" -maxdepth 1 -type f -printf '%f\n' | LC_ALL=C sort | while read -r f; do
        echo "== $f"
        cat "$recipe_dir/$f"
      done
    fi
    echo "== suite $suite"
  } | sha256sum | cut -c1-12
}

hash="$(recipe_hash)"
tag="$repo_name:$hash"
if [ "$print_tag" = 1 ]; then
  echo "$tag"
  exit 0
fi

command -v docker >/dev/null || die "docker CLI not found"
docker info >/dev/null 2>&1 || die "no Docker daemon answers (run scripts/ensure-services.sh)"

mkdir -p "$cache"
# One build at a time on this host (other engineers/CI may run ensure-services concurrently).
exec 9>"$cache/base-image.lock"
flock 9

if [ "$force" = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then
  log "$tag exists; re-tagging latest"
  docker tag "$tag" "$repo_name:latest"
  exit 0
fi

# The Debian mirror apt already uses here: the first enabled `deb` source carrying $suite.
find_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" '
      $1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
        if ($(i + 1) == suite) { print $i; exit }
      }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # deb822: paragraphs separated by blank lines.
    awk -v suite="$suite" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && enabled != "no" && (" " suites " ") ~ (" " suite " ") && uris != "") {
          split(uris, u, " "); print u[1]; found = 1; exit
        }
        types = ""; suites = ""; uris = ""; enabled = ""
      }
      /^[ \t]*$/ { flush(); next }
      /^#/ { next }
      tolower($1) == "types:" { $1 = ""; types = $0; sub(/^ +/, "", types) }
      tolower($1) == "suites:" { $1 = ""; suites = $0; sub(/^ +/, "", suites) }
      tolower($1) == "uris:" { $1 = ""; uris = $0; sub(/^ +/, "", uris) }
      tolower($1) == "enabled:" { enabled = tolower($2) }
      END { if (!found) flush() }' "$f"
  done
}

rootfs_tar="$cache/base-rootfs-$hash.tar"
if [ "$force" = 1 ] || [ ! -s "$rootfs_tar" ]; then
  [ "$(id -u)" = 0 ] || die "debootstrap needs root (or a cached $rootfs_tar)"
  command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install -y debootstrap"
  # A Debian archive root (…/debian) first: another vendor's repository with the same suite name
  # (e.g. download.docker.com/linux/debian bookworm) holds no base system.
  mirror="${FLEET_DEBIAN_MIRROR:-$({ find_mirror | grep -m1 -E '^[a-z]+://[^/]+/debian/?$' ||
    find_mirror | grep -m1 -v 'download\.docker\.com' || find_mirror | head -n1; } 2>/dev/null || true)}"
  [ -n "$mirror" ] || die "no Debian mirror for '$suite' in /etc/apt/sources.list*; set FLEET_DEBIAN_MIRROR"
  include="$(grep -v '^[[:space:]]*#' "$recipe_dir/packages.txt" | tr -s ' \t\n' '\n' | sed '/^$/d' | paste -sd, -)"

  work="$(mktemp -d "$cache/build-$hash.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
  rootfs="$work/rootfs"
  log "debootstrap --variant=minbase $suite from $mirror (+ $include)"
  debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -30 "$work/debootstrap.log" >&2
    die "debootstrap failed"
  }

  # The unprivileged agent user, uid/gid 1000, with a home.
  grep -q '^agent:' "$rootfs/etc/group" || echo "agent:x:1000:" >>"$rootfs/etc/group"
  grep -q '^agent:' "$rootfs/etc/passwd" || echo "agent:x:1000:1000:sandbox agent:/home/agent:/bin/bash" >>"$rootfs/etc/passwd"
  if [ -f "$rootfs/etc/shadow" ] && ! grep -q '^agent:' "$rootfs/etc/shadow"; then
    echo "agent:*:19000:0:99999:7:::" >>"$rootfs/etc/shadow"
  fi
  if [ -f "$rootfs/etc/gshadow" ] && ! grep -q '^agent:' "$rootfs/etc/gshadow"; then
    echo "agent:!::" >>"$rootfs/etc/gshadow"
  fi
  mkdir -p "$rootfs/home/agent"
  cp -a "$rootfs/etc/skel/." "$rootfs/home/agent/" 2>/dev/null || true
  chown -R 1000:1000 "$rootfs/home/agent"
  chmod 0750 "$rootfs/home/agent"

  # Mount points (the provider mounts a tmpfs on each; runc gives it the directory's mode).
  mkdir -p "$rootfs/workspace" "$rootfs/tests" "$rootfs/solution" "$rootfs/logs"
  chown 1000:1000 "$rootfs/workspace"
  chmod 0755 "$rootfs/workspace"
  # Docker's tmpfs copy-up gives each tmpfs the mode of the image's directory: /tests and
  # /solution stay root's (the agent must not plant files where tests are staged later).
  chmod 0755 "$rootfs/tests" "$rootfs/solution"
  chmod 1777 "$rootfs/logs"
  # The verify fence's mount point (bubblewrap cannot make one in a read-only root), as the
  # provider mounts it: nobody's (the keepalive's user, who alone writes the fence), 0755.
  mkdir -p "$rootfs/run/fleet"
  chown 65534:65534 "$rootfs/run/fleet"
  chmod 0755 "$rootfs/run/fleet"

  # No host leftovers, no package caches.
  rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/hostname"
  : >"$rootfs/etc/hosts"
  rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"* "$rootfs/var/log/"*.log \
    "$rootfs/var/cache/debconf/"*-old "$rootfs/tmp/"* "$rootfs/root/.bash_history"
  find "$rootfs" -name '__pycache__' -type d -prune -exec rm -rf {} + 2>/dev/null || true

  tar --numeric-owner -C "$rootfs" -cf "$rootfs_tar.partial" .
  mv "$rootfs_tar.partial" "$rootfs_tar"
  rm -rf "$work"
  trap - EXIT
  log "cached rootfs: $rootfs_tar ($(du -h "$rootfs_tar" | cut -f1))"
  # Older recipes' rootfs tarballs are dead weight (150 MB each).
  find "$cache" -maxdepth 1 -name 'base-rootfs-*.tar' ! -name "base-rootfs-$hash.tar" -delete
else
  log "using cached rootfs $rootfs_tar"
fi

log "docker import -> $tag"
docker import \
  --change 'CMD ["sleep","infinity"]' \
  --change 'WORKDIR /workspace' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL fleet.image=base fleet.recipe=$hash" \
  --message "rollout-fleet base sandbox image (recipe $hash)" \
  "$rootfs_tar" "$tag" >/dev/null
docker tag "$tag" "$repo_name:latest"
log "built $tag (also $repo_name:latest)"

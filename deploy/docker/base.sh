#!/usr/bin/env bash
# Builds the local base image `parse-base:bookworm` without a registry: a minimal Debian bookworm root file system
# made with debootstrap from Debian's own packages, turned into an image with `docker import`. Skips the work when
# the image exists (PARSE_REBUILD_BASE=1 forces it). Needs root (debootstrap) and a Docker Engine.
set -euo pipefail
image="${PARSE_BASE_IMAGE:-parse-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$image" > /dev/null 2>&1 && [ "${PARSE_REBUILD_BASE:-0}" != 1 ]; then
  echo "base.sh: $image exists"
  exit 0
fi
command -v debootstrap > /dev/null || {
  echo "base.sh: needs debootstrap (apt-get install debootstrap)" >&2
  exit 2
}
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
# minbase: essential packages only; ca-certificates for TLS clients, tini as PID 1 to reap and forward signals.
debootstrap --variant=minbase --include=ca-certificates,tini bookworm "$root" "$mirror"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  - "$image"
echo "base.sh: built $image ($(docker image inspect -f '{{.Size}}' "$image") bytes)"

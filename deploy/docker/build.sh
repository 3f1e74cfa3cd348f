#!/usr/bin/env bash
# Builds the CPU image `parse:<version>` (and tags `parse:latest`): the local base (base.sh), the release binaries
# (cargo build unless --no-build), stripped into a small build context, then deploy/docker/Dockerfile.
#   deploy/docker/build.sh [--no-build] [--cuda]
# --cuda stages binaries built with --features cuda,nccl and builds Dockerfile.cuda (needs a registry for its base).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
build=1
cuda=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0; shift ;;
    --cuda) cuda=1; shift ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/Cargo.toml" | head -n 1)"
bins=(parse-router parse-draft-worker parse-target-worker parsectl)
if [ "$build" = 1 ]; then
  features=()
  [ "$cuda" = 1 ] && features=(--features cuda,nccl)
  (cd "$repo" && cargo build --release -q "${features[@]}" -p parse-router -p parse-draft-worker \
    -p parse-target-worker -p parsectl)
fi
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
for b in "${bins[@]}"; do
  strip --strip-debug -o "$ctx/$b" "$repo/target/release/$b"
done
if [ "$cuda" = 1 ]; then
  docker build -q -f "$repo/deploy/docker/Dockerfile.cuda" -t "parse-cuda:$version" -t parse-cuda:latest "$ctx"
  echo "build.sh: built parse-cuda:$version"
else
  "$repo/deploy/docker/base.sh"
  docker build -q -f "$repo/deploy/docker/Dockerfile" -t "parse:$version" -t parse:latest "$ctx"
  echo "build.sh: built parse:$version ($(docker image inspect -f '{{.Size}}' "parse:$version") bytes)"
fi

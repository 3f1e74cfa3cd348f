#!/usr/bin/env bash
# The README's two commands on a fresh Debian machine: a container from the project's own debootstrap base
# (deploy/docker/base.sh) with nothing installed but what the commands install themselves. The Rust toolchain is the
# host's rustup home, mounted (no toolchain can be fetched here); crates, Debian packages, pip packages and the models
# come from their registries inside the container. Runs a clean clone of HEAD with nothing beside it.
#
#   tests/scripts/fresh-machine.sh [main|tests|both]     (default both; the test command takes ~25 min on 2 cores)
#
# Not part of CI (CI itself runs on a fresh machine): a check to run by hand after changing the set-up.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
what="${1:-both}"
image="${PARSE_BASE_IMAGE:-parse-base:bookworm}"
"$repo/deploy/docker/base.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/main"
main_cmd='deploy/setup.sh && deploy/local/up.sh && target/release/parsectl generate --router 127.0.0.1:50051 --max-new-tokens 128 "Write a Python function that returns the n-th Fibonacci number."; status=$?; deploy/local/down.sh; exit $status'
test_cmd='deploy/setup.sh --tests && deploy/models/fetch.py && deploy/eval/fetch.py && cargo build --release --workspace && cargo test --release --workspace'
case "$what" in
  main) cmd="$main_cmd" ;;
  tests) cmd="$test_cmd" ;;
  both) cmd="($main_cmd) && $test_cmd" ;;
  *) echo "usage: $0 [main|tests|both]" >&2; exit 2 ;;
esac
# The host's local certificate authorities (a network that inspects TLS needs them on every machine of it) go into
# the container's trust store before anything else runs.
cas=/usr/local/share/ca-certificates
cmd="update-ca-certificates >/dev/null && $cmd"
docker run --rm \
  -v "$cas:$cas:ro" \
  -v "$work:/work" \
  -v "${RUSTUP_HOME:-$HOME/.rustup}:/root/.rustup" \
  -v "${CARGO_HOME:-$HOME/.cargo}/bin:/opt/cargo/bin:ro" \
  -e PATH=/opt/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  -e CARGO_HOME=/root/.cargo \
  -w /work/main \
  "$image" bash -c "$cmd"
echo "fresh-machine: the README's commands ($what) passed"

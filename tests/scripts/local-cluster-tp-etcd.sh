#!/usr/bin/env bash
# The local cluster at --tp 2 --etcd --tls (deploy/local/up.sh): mutual TLS on every gRPC hop, etcd over TLS with
# client certificates, the TP ring authenticated by the cluster token. It comes up healthy, a generation through it
# equals the in-process one for the same settings (greedy: token for token), a client without the cluster's
# certificate is refused, and down.sh leaves no process behind.
# Runs on ports apart from the default cluster's. Needs the release binaries and the default models.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
run_dir="$(mktemp -d)"
export PARSE_ROUTER_PORT=51051 PARSE_ADMIN_PORT=51052 PARSE_DRAFT_PORT=51061 PARSE_TARGET_PORT=51071 \
  PARSE_TP_PORT=51081 PARSE_ETCD_PORT=53379
cleanup() { "$repo/deploy/local/down.sh" --run-dir "$run_dir" > /dev/null 2>&1 || true; rm -rf "$run_dir"; }
trap cleanup EXIT

"$repo/deploy/local/up.sh" --no-build --run-dir "$run_dir" --tp 2 --etcd --tls
cp "$run_dir/pids" "$run_dir/pids.started"
bin="$repo/target/release"
tls="$run_dir/tls"
# Without a certificate: refused.
if "$bin/parsectl" generate --router "127.0.0.1:$PARSE_ROUTER_PORT" --max-new-tokens 4 "hi" > /dev/null 2>&1; then
  echo "a client without a certificate was served" >&2
  exit 1
fi
export PARSE_TLS_CERT="$tls/client.pem" PARSE_TLS_KEY="$tls/client-key.pem" PARSE_TLS_CA="$tls/ca.pem"
# Workers' certificates name the role; health over mTLS is how a prober with a certificate reaches them.
if out=$(PARSE_TLS_SERVER_NAME=parse-worker "$bin/parsectl" health "127.0.0.1:$PARSE_DRAFT_PORT" 2>&1); then
  echo "worker health over mTLS: $out"
else
  echo "worker health over mTLS failed: $out" >&2
  exit 1
fi
prompt="Write a Python function that reverses a string."
"$bin/parsectl" generate --router "127.0.0.1:$PARSE_ROUTER_PORT" --mode parse --max-new-tokens 32 --json "$prompt" \
  > "$run_dir/remote.json"
"$bin/parsectl" generate --local --mode parse --max-new-tokens 32 --json "$prompt" > "$run_dir/local.json"
python3 - "$run_dir/remote.json" "$run_dir/local.json" <<'PY'
import json, sys
remote, local = (json.load(open(p)) for p in sys.argv[1:3])
assert remote["token_ids"] == local["token_ids"], (remote["token_ids"], local["token_ids"])
assert len(remote["token_ids"]) > 0
print(f"TP=2 + etcd cluster: {len(remote['token_ids'])} tokens, identical to the in-process run")
PY
"$repo/deploy/local/down.sh" --run-dir "$run_dir"
# Nothing that up.sh started still runs (an exited child may linger as a zombie: no command line).
left=0
while read -r name pid prog; do
  if [ -r "/proc/$pid/cmdline" ] && [ -n "$(tr -d '\0' < "/proc/$pid/cmdline")" ]; then
    echo "still running: $name ($pid)" >&2
    left=1
  fi
done < "$run_dir/pids.started"
[ "$left" = 0 ]
echo "local cluster --tp 2 --etcd --tls: ok"

#!/usr/bin/env bash
# Starts a local PARSE cluster on loopback: a target worker, a draft worker and the router, with the default model
# pair (fetched on first use). Waits until all of them report SERVING over grpc.health.v1, prints the endpoints, and
# keeps pids and logs under the run directory; deploy/local/down.sh stops exactly these processes.
#
#   deploy/local/up.sh [--run-dir DIR] [--no-build] [--tp N] [--etcd] [--tls]
#
#   --tp N   the target is a tensor-parallel group of N processes (rank r: health on PARSE_TARGET_PORT + r, group
#            connection on PARSE_TP_PORT + r, 50081 by default); rank 0 serves the router
#   --etcd   also start etcd (Debian's etcd-server; PARSE_ETCD_PORT, 52379) with its data in the run dir; workers
#            register there, the router and the TP group find each other through it
#   --tls    mutual TLS on every gRPC hop (router, admin API, workers; TLS to etcd too with --etcd): a throw-away CA
#            and certificates from `parsectl certs` in <run dir>/tls; clients need client.pem, client-key.pem and
#            ca.pem from there (up.sh prints the environment to set). The OpenAI API turns HTTPS with an API key
#            (<run dir>/tls/openai-api-key).
#
# Workers always require the cluster token (<run dir>/tls/cluster-token, fresh per start): only this cluster's
# router may open sessions on them or drain them; the TP ranks authenticate each other with it.
#
# Ports (env): PARSE_ROUTER_PORT (50051), PARSE_ADMIN_PORT (50052), PARSE_OPENAI_PORT (8000, the OpenAI HTTP API and
# the router's /metrics), PARSE_DRAFT_PORT (50061), PARSE_TARGET_PORT (50071), PARSE_DRAFT_METRICS_PORT (50062),
# PARSE_TARGET_METRICS_PORT (50070, rank 0's /metrics).
# The router's admin API gets a fresh token, written to <run dir>/admin-token (mode 600).
# Models (env): PARSE_MODEL_DIR (~/.cache/parse/models), PARSE_TARGET_MODEL, PARSE_DRAFT_MODEL (override the files).
# Binaries: built with cargo into target/release unless --no-build; PARSE_BIN_DIR points elsewhere.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
run_dir="${PARSE_RUN_DIR:-$repo/.cache/local-cluster}"
build=1
tp=1
use_etcd=0
use_tls=0
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) run_dir="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --tp) tp="$2"; shift 2 ;;
    --etcd) use_etcd=1; shift ;;
    --tls) use_tls=1; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "up.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

router_port="${PARSE_ROUTER_PORT:-50051}"
admin_port="${PARSE_ADMIN_PORT:-50052}"
openai_port="${PARSE_OPENAI_PORT:-8000}"
draft_metrics_port="${PARSE_DRAFT_METRICS_PORT:-50062}"
target_metrics_port="${PARSE_TARGET_METRICS_PORT:-50070}"
draft_port="${PARSE_DRAFT_PORT:-50061}"
target_port="${PARSE_TARGET_PORT:-50071}"
tp_port="${PARSE_TP_PORT:-50081}"
etcd_port="${PARSE_ETCD_PORT:-52379}"
case "$tp" in
  ''|*[!0-9]*|0) echo "up.sh: --tp needs a whole number >= 1, got '$tp'" >&2; exit 2 ;;
esac
if [ "$use_etcd" = 1 ] && ! command -v etcd > /dev/null; then
  echo "up.sh: --etcd needs the etcd binary (Debian: apt-get install etcd-server)" >&2
  exit 2
fi
model_dir="${PARSE_MODEL_DIR:-$HOME/.cache/parse/models}"
target_model="${PARSE_TARGET_MODEL:-$model_dir/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
draft_model="${PARSE_DRAFT_MODEL:-$model_dir/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
bin="${PARSE_BIN_DIR:-$repo/target/release}"

if [ -e "$run_dir/pids" ] && [ -s "$run_dir/pids" ]; then
  echo "up.sh: a cluster from $run_dir seems to be running; run deploy/local/down.sh first" >&2
  exit 1
fi
mkdir -p "$run_dir/logs"
: > "$run_dir/pids"

if [ ! -f "$target_model" ] || [ ! -f "$draft_model" ]; then
  echo "up.sh: fetching the default model pair into $model_dir" >&2
  PARSE_MODEL_DIR="$model_dir" python3 "$repo/deploy/models/fetch.py"
fi
if [ "$build" = 1 ]; then
  # cargo's own progress (a first build takes several minutes on a small machine).
  echo "up.sh: building the router, both workers and parsectl (cargo build --release)" >&2
  (cd "$repo" && cargo build --release -p parse-router -p parse-draft-worker -p parse-target-worker -p parsectl)
fi

fail() {
  echo "up.sh: $1" >&2
  for f in "$run_dir"/logs/*.log; do echo "--- $f" >&2; tail -n 20 "$f" >&2; done
  "$repo/deploy/local/down.sh" --run-dir "$run_dir" >&2 || true
  exit 1
}

start() { # name, command...
  local name="$1"; shift
  setsid "$@" > "$run_dir/logs/$name.log" 2>&1 < /dev/null &
  echo "$name $! $1" >> "$run_dir/pids"
}

wait_healthy() { # name, addr, [server name in its certificate]
  echo "up.sh: waiting for $1 at $2 to report SERVING" >&2
  local name_args=()
  [ -n "${3:-}" ] && name_args=(--tls-server-name "$3")
  "$bin/parsectl" health "$2" "${name_args[@]}" --wait-s "${PARSE_UP_TIMEOUT_S:-180}" > /dev/null 2>&1 \
    || fail "$1 at $2 did not become healthy"
}

# Credentials: the cluster token always, certificates with --tls. Each process reads its own through the
# environment (files, never values on the command line, which `ps` shows).
tls="$run_dir/tls"
rm -rf "$tls"
if [ "$use_tls" = 1 ]; then
  "$bin/parsectl" certs "$tls" > /dev/null || fail "parsectl certs failed"
else
  mkdir -p "$tls"
  (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32))' > "$tls/cluster-token")
fi
export PARSE_CLUSTER_TOKEN_FILE="$tls/cluster-token"
as() { # role (router|worker|client): the TLS environment of that role, when --tls
  if [ "$use_tls" = 1 ]; then
    export PARSE_TLS_CERT="$tls/$1.pem" PARSE_TLS_KEY="$tls/$1-key.pem" PARSE_TLS_CA="$tls/ca.pem"
  fi
}

etcd_args=()
if [ "$use_etcd" = 1 ]; then
  etcd_tls=()
  etcd_url="http://127.0.0.1:$etcd_port"
  if [ "$use_tls" = 1 ]; then
    # Client-certificate authentication: only holders of a cluster certificate reach etcd.
    etcd_url="https://127.0.0.1:$etcd_port"
    etcd_tls=(--cert-file "$tls/worker.pem" --key-file "$tls/worker-key.pem" --trusted-ca-file "$tls/ca.pem"
      --client-cert-auth)
    export PARSE_ETCD_CA="$tls/ca.pem" PARSE_ETCD_CERT="$tls/client.pem" PARSE_ETCD_KEY="$tls/client-key.pem"
  fi
  start etcd "$(command -v etcd)" --name parse-local --data-dir "$run_dir/etcd" "${etcd_tls[@]}" \
    --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
    --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
    --initial-cluster "parse-local=http://127.0.0.1:$((etcd_port + 1))"
  for _ in $(seq 1 100); do
    (exec 3<> "/dev/tcp/127.0.0.1/$etcd_port") 2> /dev/null && break
    sleep 0.1
  done
  etcd_args=(--etcd "$etcd_url")
fi

# The target: one process, or a group of $tp ranks.
tp_addrs=""
for r in $(seq 0 $((tp - 1))); do tp_addrs="$tp_addrs${tp_addrs:+,}127.0.0.1:$((tp_port + r))"; done
for r in $(seq 0 $((tp - 1))); do
  group_args=()
  if [ "$tp" -gt 1 ]; then
    group_args=(--tp "$tp" --rank "$r")
    if [ "$use_etcd" = 1 ]; then
      group_args+=(--tp-group local --tp-listen "127.0.0.1:$((tp_port + r))")
    else
      group_args+=(--tp-addrs "$tp_addrs")
    fi
  fi
  name=target-worker
  [ "$tp" -gt 1 ] && name="target-rank$r"
  # The group's leader (rank 0) serves the worker API and its metrics; followers only compute.
  [ "$r" = 0 ] && group_args+=(--metrics-listen "127.0.0.1:$target_metrics_port")
  as worker
  start "$name" "$bin/parse-target-worker" --model "$target_model" --listen "127.0.0.1:$((target_port + r))" \
    "${group_args[@]}" "${etcd_args[@]}"
done
as worker
start draft-worker "$bin/parse-draft-worker" --model "$draft_model" --listen "127.0.0.1:$draft_port" \
  --metrics-listen "127.0.0.1:$draft_metrics_port" "${etcd_args[@]}"
as client
for r in $(seq 0 $((tp - 1))); do
  wait_healthy "target rank $r" "127.0.0.1:$((target_port + r))" parse-worker
done
wait_healthy draft-worker "127.0.0.1:$draft_port" parse-worker
(umask 077 && python3 -c 'import secrets; print(secrets.token_hex(16))' > "$run_dir/admin-token")
# The token goes through the environment, not the command line (which `ps` shows).
PARSE_ADMIN_TOKEN="$(cat "$run_dir/admin-token")"
export PARSE_ADMIN_TOKEN
if [ "$use_etcd" = 1 ]; then
  router_args=("${etcd_args[@]}")
else
  router_args=(--target "127.0.0.1:$target_port" --draft "127.0.0.1:$draft_port")
fi
as router
openai_scheme=http
if [ "$use_tls" = 1 ]; then
  (umask 077 && python3 -c 'import secrets; print("sk-" + secrets.token_hex(24))' > "$tls/openai-api-key")
  export PARSE_OPENAI_TLS=true PARSE_OPENAI_API_KEY_FILE="$tls/openai-api-key"
  openai_scheme=https
fi
# The router dials workers by address; their certificates name the role.
PARSE_TLS_SERVER_NAME=parse-worker start router "$bin/parse-router" --listen "127.0.0.1:$router_port" \
  --admin-listen "127.0.0.1:$admin_port" --openai-listen "127.0.0.1:$openai_port" "${router_args[@]}"
unset PARSE_ADMIN_TOKEN PARSE_CLUSTER_TOKEN_FILE PARSE_OPENAI_TLS PARSE_OPENAI_API_KEY_FILE
as client
wait_healthy router "127.0.0.1:$router_port"
if [ "$use_etcd" = 1 ]; then
  # Discovery: the router serves once it has found both workers.
  for _ in $(seq 1 100); do
    n=$(PARSE_ADMIN_TOKEN="$(cat "$run_dir/admin-token")" "$bin/parsectl" workers --admin "127.0.0.1:$admin_port" \
      --json 2> /dev/null | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["workers"]))' \
      2> /dev/null || echo 0)
    [ "$n" -ge 2 ] && break
    sleep 0.2
  done
  [ "$n" -ge 2 ] || fail "the router did not discover the workers through etcd"
fi

tls_note="plain text on loopback; workers require the cluster token ($tls/cluster-token)"
tls_env=""
curl_tls=""
if [ "$use_tls" = 1 ]; then
  tls_note="mutual TLS on every gRPC hop (CA and certificates in $tls); OpenAI API over HTTPS with an API key"
  tls_env="export PARSE_TLS_CERT=$tls/client.pem PARSE_TLS_KEY=$tls/client-key.pem PARSE_TLS_CA=$tls/ca.pem
     "
  curl_tls="--cacert $tls/ca.pem -H \"Authorization: Bearer \$(cat $tls/openai-api-key)\" "
fi

cat <<MSG
PARSE local cluster is up (run dir $run_dir)
  security        $tls_note
  router          127.0.0.1:$router_port   (parse.v1.Generation)
  admin API       127.0.0.1:$admin_port   (parse.v1.Admin; token in $run_dir/admin-token)
  OpenAI API      $openai_scheme://127.0.0.1:$openai_port/v1   (chat/completions, completions, models; /health)
  metrics         $openai_scheme://127.0.0.1:$openai_port/metrics (router)  http://127.0.0.1:$draft_metrics_port/metrics (draft)
                  http://127.0.0.1:$target_metrics_port/metrics (target)
  draft worker    127.0.0.1:$draft_port   ($(basename "$draft_model"))
  target worker   127.0.0.1:$target_port   ($(basename "$target_model"), tensor-parallel size $tp)
  etcd            $([ "$use_etcd" = 1 ] && echo "127.0.0.1:$etcd_port" || echo "not used")
  logs            $run_dir/logs
Try: ${tls_env}curl -s ${curl_tls}$openai_scheme://127.0.0.1:$openai_port/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}'
     $bin/parsectl generate --router 127.0.0.1:$router_port --mode parse+token-spec "Write a Python function that reverses a string."
     PARSE_ADMIN_TOKEN=\$(cat $run_dir/admin-token) $bin/parsectl workers --admin 127.0.0.1:$admin_port
Stop: deploy/local/down.sh
MSG

#!/usr/bin/env bash
# Stops exactly the processes deploy/local/up.sh started (pids from the run directory, each checked to still be the
# program that was started): SIGTERM, then SIGKILL after a grace period.
#
#   deploy/local/down.sh [--run-dir DIR]
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
run_dir="${PARSE_RUN_DIR:-$repo/.cache/local-cluster}"
while [ $# -gt 0 ]; do
  case "$1" in
    --run-dir) run_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "down.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

pids_file="$run_dir/pids"
if [ ! -s "$pids_file" ]; then
  echo "down.sh: nothing to stop ($pids_file is absent or empty)"
  exit 0
fi

# Only pids whose command line is still the started program (a pid may have been reused).
ours() { # pid, program
  [ -r "/proc/$1/cmdline" ] && tr '\0' '\n' < "/proc/$1/cmdline" | head -n 1 | grep -qxF "$2"
}

live=()
while read -r name pid prog; do
  if ours "$pid" "$prog"; then
    kill -TERM "$pid" 2> /dev/null || true
    live+=("$pid:$prog:$name")
  fi
done < "$pids_file"

for _ in $(seq 1 50); do
  left=()
  for e in "${live[@]}"; do
    IFS=: read -r pid prog name <<< "$e"
    if ours "$pid" "$prog"; then left+=("$e"); fi
  done
  live=("${left[@]}")
  [ ${#live[@]} -eq 0 ] && break
  sleep 0.2
done
for e in "${live[@]}"; do
  IFS=: read -r pid prog name <<< "$e"
  echo "down.sh: $name ($pid) ignored SIGTERM; killing" >&2
  kill -KILL "$pid" 2> /dev/null || true
done
: > "$pids_file"
echo "PARSE local cluster stopped ($run_dir)"

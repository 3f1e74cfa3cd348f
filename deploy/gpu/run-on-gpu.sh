#!/usr/bin/env bash
# The GPU run, on a GPU host from a copied tree (no Rust toolchain, no network): what travels is the tree and
# .cache/gpu/gpu-bench.xz, built here by deploy/gpu/build-cuda.sh (stripped, xz-compressed; no model files: the
# models are random at the real shapes). Finds the CUDA 13 libraries the host's PyTorch brought, runs gpu-bench on
# cuda:0 (checks against the CPU kernel model, then step timings for the 0.5B, 1.5B and 7B shapes), runs PyTorch
# eager on the same shapes for comparison, and prints one table. Results under $OUT (or /tmp/parse-gpu).
#
#   deploy/gpu/run-on-gpu.sh                       # everything
#   deploy/gpu/run-on-gpu.sh --shapes 1.5b         # arguments go to gpu-bench
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/parse-gpu}
mkdir -p "$out"
bin=/tmp/parse-gpu-bench
if [ -f .cache/gpu/gpu-bench.xz ]; then
    xz -dc .cache/gpu/gpu-bench.xz > "$bin"
elif [ -f .cache/gpu/gpu-bench ]; then
    cp .cache/gpu/gpu-bench "$bin"
else
    echo "run-on-gpu: no .cache/gpu/gpu-bench.xz: build it with deploy/gpu/build-cuda.sh and carry .cache/gpu" >&2
    exit 1
fi
chmod +x "$bin"
# cuBLAS, cuRAND, NVRTC and the CUDA runtime of CUDA 13, from the wheels of the Python that holds PyTorch; the driver
# (libcuda.so.1) is the host's own.
libs=$(python3 - <<'EOF'
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if p.endswith("-packages")])
dirs = []
for r in sorted(roots):
    for pattern in ("nvidia/cu13/lib", "nvidia/*/lib", "torch/lib"):
        dirs += [d for d in glob.glob(os.path.join(r, pattern)) if os.path.isdir(d)]
print(":".join(dict.fromkeys(dirs)))
EOF
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if missing=$(ldd "$bin" | grep 'not found'); then
    echo "run-on-gpu: libraries not found: $missing (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)" >&2
    exit 1
fi
ldd "$bin" | grep -E 'cuda|cublas|curand|nvrtc' | tee "$out/ldd.txt"
set -o pipefail
# A failed check still lets PyTorch's timings run; the script exits with gpu-bench's status at the end.
status=0
"$bin" --device cuda:0 --json "$out/gpu-bench.json" --record "$out/gpu-bench.record.json" "$@" 2>&1 \
    | tee "$out/gpu-bench.txt" || status=$?
# The record names the host's CPU; the GPU it ran on goes into its settings.
python3 - "$out" <<'EOF_RECORD' || true
import json, sys
out = sys.argv[1]
path = f"{out}/gpu-bench.record.json"
r = json.load(open(path))
r["settings"]["gpu"] = open(f"{out}/gpu.txt").read().strip()
json.dump(r, open(path, "w"), indent=2)
EOF_RECORD
PYTHONUNBUFFERED=1 python3 deploy/gpu/torch-step.py --shapes 0.5b,1.5b,7b --context 512 --block 64 \
    --batch 1,8,32,64 --json "$out/torch.json" 2>&1 | tee "$out/torch.txt"
python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
ours = {r["shape"]: r for r in json.load(open(f"{out}/gpu-bench.json"))["results"]}
torch = {r["shape"]: r for r in json.load(open(f"{out}/torch.json"))}
gpu = open(f"{out}/gpu.txt").read().strip()
print(f"\n{gpu}: the engine (candle backend, GGUF formats) against PyTorch eager (fp16), a session of 512 tokens")
print("| shape | engine step ms | torch step ms | engine / torch | engine 64-row block (x step) | torch 64-row block (x step) |")
print("|---|---:|---:|---:|---:|---:|")
for s, r in ours.items():
    step = r["steps"][0]["ms"]
    b64 = next((x for x in r["steps"] if x["rows"] == 64), None)
    t = torch.get(s)
    print(f"| {s} | {step:.2f} | {t['step_ms']:.2f} | {step / t['step_ms']:.2f} | "
          f"{b64['x_step'] if b64 else float('nan'):.2f} | {t['block_x_step']:.2f} |" if t else f"| {s} | {step:.2f} | | | | |")
print("\nDecode steps of n sessions in one pass (continuous batching): ms per pass, rows/s (x one session's)")
print("| shape | sessions | engine, attention per session | engine, attention batched | torch eager |")
print("|---|---:|---|---|---|")
for s, r in ours.items():
    tb = {b["sessions"]: b for b in torch.get(s, {}).get("batched", [])}
    t1 = tb.get(1)
    eng = {(b["sessions"], b.get("attention", "sessions")): b for b in r.get("batched", []) if b.get("rows") == 1}
    cell = lambda b: f"{b['ms']:.2f} ms, {b['rows_per_s']:.0f} ({b['x_one_session']:.2f}x)" if b else ""
    for n in sorted({k[0] for k in eng}):
        t = tb.get(n)
        tcell = f"{t['ms']:.2f} ms, {t['rows_per_s']:.0f} ({t['rows_per_s'] / t1['rows_per_s']:.2f}x)" if t and t1 else ""
        print(f"| {s} | {n} | {cell(eng.get((n, 'sessions')))} | {cell(eng.get((n, 'batch')))} | {tcell} |")
EOF
exit $status

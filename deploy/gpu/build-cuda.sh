#!/usr/bin/env bash
# The GPU build on a machine with no GPU and no CUDA install, as CI runs it on every submission:
#   1. NVIDIA's PyPI wheels pinned to CUDA 13.0 (the GPU hosts run driver 580 = CUDA 13.0; a newer nvcc emits PTX
#      that driver cannot load), unpacked under .cache/cuda13.0 (git-ignored);
#   2. a link directory: the unversioned names the linker looks for (libcublas.so -> libcublas.so.13, ...) and a
#      stub libcuda.so (soname libcuda.so.1) with every driver entry point cudarc declares, generated from cudarc's
#      own bindings: at run time the host's driver provides the real one;
#   3. `cargo check --features cuda,nccl` of the workspace (the NCCL backend compiles);
#   4. `cargo build --release` with CUDA (compute capability 9.0) of gpu-bench and both worker binaries, into
#      target/cuda so the CPU build's artifacts stay as they are; stripped copies in target/cuda/dist with their
#      sizes, and gpu-bench compressed for carrying to a GPU host (.cache/gpu/gpu-bench.xz).
# About 1.5 GB of wheels the first time; the builds take 10-15 minutes on 2 cores.
#
#   deploy/gpu/build-cuda.sh              # all of the above
#   deploy/gpu/build-cuda.sh --check      # steps 1-3 only
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# Tools beyond the Rust build's: the stub's C compiler, readelf/strip (binutils), xz.
need=()
command -v cc >/dev/null || need+=(build-essential)
command -v readelf >/dev/null || need+=(binutils)
command -v xz >/dev/null || need+=(xz-utils)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null
    else
        echo "build-cuda: missing Debian packages: sudo apt-get install -y ${need[*]}" >&2
        exit 1
    fi
fi
cache="$root/.cache/cuda13.0"
pins=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
      nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-curand==10.4.0.35 nvidia-cublas==13.0.2.14
      nvidia-nccl-cu13==2.28.9)
if [ "$(cat "$cache/.complete" 2>/dev/null)" != "${pins[*]}" ]; then
    echo "build-cuda: installing ${pins[*]} into $cache"
    # All in one go into an empty directory: pip --target skips a namespace directory (nvidia/) that exists.
    rm -rf "$cache"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$cache" "${pins[@]}"
    echo "${pins[*]}" > "$cache/.complete"
fi
cu="$cache/nvidia/cu13"
nccl="$cache/nvidia/nccl"
export PATH="$cu/bin:$PATH"
export CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_HOME="$cu"
# cudarc binds the driver API of this version: no entry point newer than the hosts' driver.
export CUDARC_CUDA_VERSION=13000
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export NCCL_INCLUDE_DIR="$nccl/include"
export CPATH="$cu/include:$nccl/include${CPATH:+:$CPATH}"
nvcc --version | tail -n 2

# The link directory.
link="$cache/link"
mkdir -p "$link"
for lib in "$cu"/lib/lib{cublas,cublasLt,cudart,nvrtc}.so.13 "$cu/lib/libcurand.so.10" "$nccl/lib/libnccl.so.2"; do
    name=$(basename "$lib")
    ln -sf "$lib" "$link/${name%%.so*}.so"
done
cd "$root"
cudarc=$(cargo metadata --format-version 1 --locked --all-features 2>/dev/null | python3 -c "
import json, sys
pkgs = json.load(sys.stdin)['packages']
print(next(p['manifest_path'] for p in pkgs if p['name'] == 'cudarc').rsplit('/', 1)[0])")
bindings="$cudarc/src/driver/sys/mod.rs"
[ -f "$bindings" ] || { echo "build-cuda: cudarc's driver bindings not found at $bindings" >&2; exit 1; }
stub_c="$link/libcuda-stub.c"
{
    echo "/* Link stub: every driver entry point cudarc declares; the host's libcuda.so.1 provides them at run time. */"
    grep -oE '^ +fn cu[A-Za-z0-9_]+\(' "$bindings" | sed -E 's/^ +fn (cu[A-Za-z0-9_]+)\(/\1/' | sort -u \
        | sed 's/.*/int &(void) { return 999; }/'
} > "$stub_c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$stub_c"
echo "build-cuda: libcuda.so stub with $(grep -c '^int ' "$stub_c") entry points"
export LIBRARY_PATH="$link${LIBRARY_PATH:+:$LIBRARY_PATH}"

echo "build-cuda: cargo check --features cuda,nccl"
cargo check --release --target-dir target/cuda --workspace --features cuda,nccl
[ "${1:-}" = --check ] && { echo "build-cuda: the GPU build (features cuda, nccl) compiles"; exit 0; }

echo "build-cuda: cargo build --release with CUDA: gpu-bench, parse-target-worker, parse-draft-worker"
cargo build --release --target-dir target/cuda -p parse-bench --features parse-bench/cuda --bin gpu-bench
cargo build --release --target-dir target/cuda -p parse-target-worker -p parse-draft-worker \
    --features parse-target-worker/cuda,parse-draft-worker/cuda
dist=target/cuda/dist
mkdir -p "$dist" .cache/gpu
: > "$dist/sizes.txt"
for b in gpu-bench parse-target-worker parse-draft-worker; do
    strip -o "$dist/$b" "target/cuda/release/$b"
    # What the binary needs from the host: the driver and CUDA 13 libraries, nothing from this machine.
    needed=$(readelf -d "$dist/$b" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    awk -v n="$b" -v s="$(stat -c %s "$dist/$b")" -v d="$needed" \
        'BEGIN { printf "%-20s %6.1f MiB stripped  needs: %s\n", n, s / 1048576, d }' | tee -a "$dist/sizes.txt"
done
grep -q 'libcuda.so.1' <<< "$(readelf -d "$dist/gpu-bench")" \
    || { echo "build-cuda: gpu-bench does not link the CUDA driver" >&2; exit 1; }
xz -9 -T0 -c "$dist/gpu-bench" > .cache/gpu/gpu-bench.xz
awk -v s="$(stat -c %s .cache/gpu/gpu-bench.xz)" \
    'BEGIN { printf "%-20s %6.1f MiB (xz, carried to the GPU host)\n", "gpu-bench.xz", s / 1048576 }' | tee -a "$dist/sizes.txt"
echo "build-cuda: the GPU binaries build and link; sizes in $dist/sizes.txt"

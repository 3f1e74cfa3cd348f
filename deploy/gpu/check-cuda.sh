#!/usr/bin/env bash
# Checks that the GPU build compiles (`cargo check --features cuda,nccl`) on a machine with no GPU and no CUDA
# install: the toolkit pieces the build scripts need (nvcc and headers for candle's kernels, NCCL's headers) come
# from NVIDIA's PyPI wheels, unpacked under .cache/cuda (git-ignored). The check builds into target/cuda-check, so
# the CPU build's artifacts are left alone. About 10 minutes and 1.6 GB the first time.
#
#   deploy/gpu/check-cuda.sh            # check the workspace with --features cuda,nccl
#   CUDA_COMPUTE_CAP=80 deploy/gpu/check-cuda.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cache="$root/.cache/cuda"
wheels=(nvidia-cuda-nvcc nvidia-cuda-cccl nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-crt
        nvidia-nvvm nvidia-curand nvidia-cublas nvidia-nccl-cu13)
if [ ! -x "$cache/nvidia/cu13/bin/nvcc" ] || [ ! -f "$cache/.complete" ]; then
    echo "check-cuda: installing ${wheels[*]} into $cache"
    # All in one go into an empty directory: pip --target skips a namespace directory (nvidia/) that exists.
    rm -rf "$cache"
    python3 -m pip install --quiet --no-deps --target "$cache" "${wheels[@]}"
    touch "$cache/.complete"
fi
cu="$cache/nvidia/cu13"
export PATH="$cu/bin:$PATH"
export CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_HOME="$cu"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13040}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export NCCL_INCLUDE_DIR="$cache/nvidia/nccl/include"
export CPATH="$cu/include:$cache/nvidia/nccl/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$cu/lib:$cache/nvidia/nccl/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
nvcc --version | tail -n 2
cd "$root"
cargo check --release --target-dir target/cuda-check --workspace --features cuda,nccl
echo "check-cuda: the GPU build (features cuda, nccl) compiles"

#!/usr/bin/env bash
# Builds llama.cpp's `llama-bench` from the source vendored in a pinned llama-cpp-python sdist, outside the
# repository's tracked files (under .cache/llama-cpp, git-ignored), for side-by-side engine figures:
#   benches/llama-cpp/build.sh            # prints the path of llama-bench
#   target/release/engine-bench --llama-bench "$(benches/llama-cpp/build.sh)"
# Nothing of llama.cpp is committed. Its AMX path crashes on the project's machines (a SIGSEGV in
# ggml_backend_amx_mul_mat), and GGML_NATIVE turns it on wherever the CPU has AMX, so the build names its
# instruction sets instead: AVX-512 (F/BW/VL/DQ/CD), VNNI, AVX-VNNI and BF16 when this CPU has them, else AVX2.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DIR="$ROOT/.cache/llama-cpp/$VERSION"
BIN="$DIR/build/bin/llama-bench"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
command -v cmake >/dev/null || {
    echo "llama-cpp: cmake is missing (apt-get install cmake)" >&2
    exit 1
}
mkdir -p "$DIR"
if [[ ! -d "$DIR/src" ]]; then
    # Only this package from source; its build tools may come as wheels.
    pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR" >&2
    tar -xzf "$DIR/llama_cpp_python-$VERSION.tar.gz" -C "$DIR"
    mv "$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
    rm -rf "$DIR/llama_cpp_python-$VERSION"
fi
ISA=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo; then
    ISA+=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON)
    # The VEX-encoded AVX-VNNI is a flag of its own: AMD's Zen 4 has AVX-512 VNNI without it (llama-bench died of
    # SIGILL on the draft's Q8_0 path there when it was assumed).
    grep -qw avx_vnni /proc/cpuinfo && ISA+=(-DGGML_AVX_VNNI=ON)
    grep -qw avx512_bf16 /proc/cpuinfo && ISA+=(-DGGML_AVX512_BF16=ON)
    grep -qw avx512vbmi /proc/cpuinfo && ISA+=(-DGGML_AVX512_VBMI=ON)
fi
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${ISA[@]}" \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$DIR/build" --target llama-bench -j "$(nproc)" >&2
echo "$BIN"

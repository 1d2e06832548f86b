#!/usr/bin/env bash
# Builds the llama.cpp peer of bench/peers.py into $1 (default .peers), once: llama-cpp-python's
# Python bindings over llama.cpp's shared libraries compiled for this machine's CPU, the strongest
# build it runs. Only the libraries are compiled (libllama, libggml*: ~5-10 minutes on 2 cores),
# from the sources in llama-cpp-python's sdist (pip download), with CMake + Ninja; the Python package
# is copied beside them and its one missing dependency (diskcache) installed into $1.
#
# Instruction sets come from /proc/cpuinfo: GGML_NATIVE is off (a native build can pick instructions
# the CPU lacks, e.g. AVX-VNNI on some EPYCs, and die with an illegal instruction), and each of AVX,
# AVX2, FMA, F16C, AVX-512 (F, VBMI, VNNI, BF16) is on exactly when the CPU reports it. AMX stays off
# unless LLAMA_CPP_AMX=ON: its buffer type segfaulted on the AMX Xeon these benchmarks ran on (issue
# 36). Exit status 0 when the peer is importable afterwards (PYTHONPATH=$1 python -c 'import llama_cpp').
set -euo pipefail
TARGET="$(realpath -m "${1:-.peers}")"
PY="${PY:-.venv/bin/python}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
if PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already built in $TARGET"
    exit 0
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
ARGS="$ARGS -DGGML_BMI2=$(has bmi2) -DGGML_SSE42=$(has sse4_2)"
ARGS="$ARGS -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
ARGS="$ARGS -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
amx="${LLAMA_CPP_AMX:-OFF}"
ARGS="$ARGS -DGGML_AMX_TILE=$amx -DGGML_AMX_INT8=$amx -DGGML_AMX_BF16=$amx"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION" >/dev/null
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
echo "building llama.cpp (llama-cpp-python $VERSION's sources) with: $ARGS"
cmake -S "$SRC/vendor/llama.cpp" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON $ARGS >"$WORK/cmake.log" || { cat "$WORK/cmake.log"; exit 1; }
grep -m1 'Adding CPU backend variant' "$WORK/cmake.log" || true
ninja -C "$WORK/build" -j "$JOBS" llama
rm -rf "$TARGET"
mkdir -p "$TARGET"
cp -r "$SRC/llama_cpp" "$TARGET/llama_cpp"
mkdir -p "$TARGET/llama_cpp/lib"
cp -P "$WORK"/build/bin/lib*.so* "$TARGET/llama_cpp/lib/"
"$PY" -m pip install --no-deps --target "$TARGET" diskcache >/dev/null
PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'built in $TARGET')"

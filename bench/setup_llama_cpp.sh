#!/usr/bin/env bash
# Builds llama-cpp-python (the llama.cpp peer of bench/peers.py) for this machine's CPU into $1
# (default .peers), once: the strongest build this CPU runs. The build takes ~12 minutes on 2 cores.
# Flags come from /proc/cpuinfo: GGML_NATIVE is off (a native build can pick instructions the CPU
# lacks, e.g. AVX-VNNI on some EPYCs, and die with an illegal instruction), and each of AVX, AVX2,
# FMA, F16C, AVX-512 (F, VBMI, VNNI, BF16) is on exactly when the CPU reports it. AMX stays off: its
# buffer type segfaulted on the AMX Xeon these benchmarks ran on (issue 36); set LLAMA_CPP_AMX=ON to
# try it. Exit status 0 when the peer is importable afterwards.
set -euo pipefail
TARGET="${1:-.peers}"
PY="${PY:-.venv/bin/python}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
if PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already built in $TARGET"
    exit 0
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
ARGS="$ARGS -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
ARGS="$ARGS -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"
amx="${LLAMA_CPP_AMX:-OFF}"
ARGS="$ARGS -DGGML_AMX_TILE=$amx -DGGML_AMX_INT8=$amx -DGGML_AMX_BF16=$amx"
echo "building llama-cpp-python==$VERSION into $TARGET with CMAKE_ARGS: $ARGS (about 12 minutes on 2 cores)"
rm -rf "$TARGET"
CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-cache-dir --target "$TARGET" \
    "llama-cpp-python==$VERSION"
PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'built in $TARGET')"

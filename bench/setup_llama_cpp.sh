#!/usr/bin/env bash
# Builds llama-cpp-python (the llama.cpp peer of bench/peers.py) for this machine's CPU into $1
# (default .peers), once: the strongest build this CPU runs, which is llama.cpp's native build
# (GGML_NATIVE=ON: -march=native, every instruction set this CPU reports, as llama.cpp's own
# release instructions build it). A build with hand-picked flags measured 3 tok/s on the AMX Xeon
# where the native one measured 87. The build takes ~12 minutes on 2 cores. The AMX buffer type
# segfaulted on that Xeon (issue 36), so bench/peers.py loads models with use_extra_bufts=False and
# says so in its table. The build is for this machine only: .peers/ records the CPU it was built on
# and the script rebuilds when run on another. Exit status 0 when the peer is importable afterwards.
set -euo pipefail
TARGET="${1:-.peers}"
PY="${PY:-.venv/bin/python}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
cpu="$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs || true) $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)"
if [[ -f "$TARGET/.built-for" && "$(cat "$TARGET/.built-for")" == "$cpu" ]] \
    && PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already built natively in $TARGET for this CPU ($cpu)"
    exit 0
fi
ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
echo "building llama-cpp-python==$VERSION natively into $TARGET with CMAKE_ARGS: $ARGS (about 12 minutes on 2 cores)"
rm -rf "$TARGET"
CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-cache-dir --target "$TARGET" \
    "llama-cpp-python==$VERSION"
PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'built in $TARGET')"
echo "$cpu" > "$TARGET/.built-for"

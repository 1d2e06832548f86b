#!/usr/bin/env bash
# Builds the llama.cpp peer of bench/peers.py into $1 (default .peers), once: llama-cpp-python's Python
# bindings over llama.cpp's shared libraries compiled natively for this machine's CPU (GGML_NATIVE=ON:
# -march=native, every instruction set this CPU reports, as llama.cpp's own build instructions do), the
# strongest build it runs. A build with hand-picked flags measured 3 tok/s on an AMX Xeon where the native
# one measured 87. Only the libraries are compiled (libllama, libggml*: ~5-15 minutes on 2 cores), from the
# sources in llama-cpp-python's sdist (pip download), with CMake + Ninja; the Python package is copied
# beside them and its one missing dependency (diskcache) installed into $1. The build is for this machine
# only: $1/.built-for records the CPU it was built on, and the script rebuilds on another.
# llama.cpp's AMX buffer type segfaulted on that Xeon (issue 36): bench/peers.py loads models without the
# extra buffer types where the CPU reports AMX, and says so in its table.
# Exit status 0 when the peer is importable afterwards (PYTHONPATH=$1 python -c 'import llama_cpp').
set -euo pipefail
TARGET="$(realpath -m "${1:-.peers}")"
PY="${PY:-.venv/bin/python}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
JOBS="${JOBS:-$(nproc)}"
cpu="$(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs || true) $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)"
if [[ -f "$TARGET/.built-for" && "$(cat "$TARGET/.built-for")" == "$cpu" ]] \
    && PYTHONPATH="$TARGET" "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already built natively in $TARGET for this CPU ($cpu)"
    exit 0
fi
ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION" >/dev/null
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION"
echo "building llama.cpp natively (llama-cpp-python $VERSION's sources) with: $ARGS"
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
echo "$cpu" > "$TARGET/.built-for"

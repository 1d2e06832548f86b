#!/usr/bin/env bash
# Compile, verify and time helexa's kernels on a CUDA machine (torch 2.11 / triton 3.6, no network).
# Checks run before timings; one table is printed and written to bench/out/gpu_check.md.
# Usage: bench/gpu_check.sh [--dry-run] [--budget-s S]      (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Hard stop at 8 minutes; the script itself skips remaining timings after --budget-s (450 s).
exec timeout 480 "$PYTHON" bench/gpu_check.py "$@"

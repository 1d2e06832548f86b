#!/usr/bin/env bash
# Compile, verify and time helexa's kernels on a CUDA machine (torch 2.11 / triton 3.6, no network).
# Checks run before timings; one table is printed and written to bench/out/gpu_check.md.
# Usage: bench/gpu_check.sh [--dry-run] [--budget-s S]      (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Tensor parallelism (NCCL) on a host with two GPUs or more: TP 2 vs TP 1 greedy parity and step overhead.
GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [[ " $* " != *" --dry-run "* ]]; then
  if [ "${GPUS:-0}" -ge 2 ]; then
    timeout 240 "$PYTHON" bench/tp_overhead.py --tp 2 --device cuda --dtype float32 --repeats 20 \
      || echo "gpu_check: tensor-parallel check FAILED (status $?)" >&2
  else
    echo "gpu_check: ${GPUS:-0} GPU(s): tensor-parallel check skipped (needs 2)"
  fi
fi
# Hard stop at 8 minutes; the script itself skips remaining timings after --budget-s (450 s).
exec timeout 480 "$PYTHON" bench/gpu_check.py "$@"

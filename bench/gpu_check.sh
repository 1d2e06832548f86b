#!/usr/bin/env bash
# Compile, verify and time helexa on a CUDA machine (torch 2.11 / triton 3.6, no network), in one call:
#   1. bench/gpu_engine.py: the engine end to end on a random-weight Llama-shaped model built there;
#   2. bench/gpu_invariance.py: which step operations are batch invariant there, bit for bit;
#   3. bench/gpu_check.py: every kernel against its fp64 reference, then kernel timings (skipped past --budget-s).
# Each writes a markdown table to bench/out/ (and to $OUT when set, so a device run's files come back).
# Usage: bench/gpu_check.sh [--dry-run] [--budget-s S]      (PYTHON=... to choose the interpreter)
# Environment: CHECK_SECONDS, ENGINE_SECONDS (hard limits of the two parts; 240 and 150 by default;
# --budget-s, counted from gpu_check.py's start, should end well inside CHECK_SECONDS).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTDIR="${OUT:-bench/out}"
mkdir -p "$OUTDIR" bench/out
DRY=""
[[ " $* " == *" --dry-run "* ]] && DRY="--dry-run"
status=0
# Tensor parallelism (NCCL) on a host with two GPUs or more: TP 2 vs TP 1 greedy parity and step overhead.
GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUTDIR/gpu.txt"
  if [ "${GPUS:-0}" -ge 2 ]; then
    timeout 240 "$PYTHON" bench/tp_overhead.py --tp 2 --device cuda --dtype float32 --repeats 20 \
      || { echo "gpu_check: tensor-parallel check FAILED (status $?)" >&2; status=1; }
  else
    echo "gpu_check: ${GPUS:-0} GPU(s): tensor-parallel check skipped (needs 2)"
  fi
fi
timeout "${ENGINE_SECONDS:-150}" "$PYTHON" bench/gpu_engine.py $DRY --out "$OUTDIR/gpu_engine.md" 2>&1 \
  | grep -v -E "^(INFO|DEBUG)" | tee "$OUTDIR/gpu_engine.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: engine checks ended with status $rc" >&2; status=1; }
timeout 120 "$PYTHON" bench/gpu_invariance.py $DRY --out "$OUTDIR/gpu_invariance.md" 2>&1 | tee "$OUTDIR/gpu_invariance.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: invariance survey ended with status $rc" >&2; status=1; }
timeout "${CHECK_SECONDS:-240}" "$PYTHON" bench/gpu_check.py "$@" --out "$OUTDIR/gpu_check.md" 2>&1 \
  | tee "$OUTDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: kernel checks ended with status $rc" >&2; status=1; }
[ "$OUTDIR" != bench/out ] && cp "$OUTDIR"/gpu_check.md "$OUTDIR"/gpu_engine.md "$OUTDIR"/gpu_invariance.md bench/out/ 2>/dev/null
exit $status

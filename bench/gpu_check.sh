#!/usr/bin/env bash
# Compile, verify and time helexa on a CUDA machine (torch 2.11 / triton 3.6, no network), in one call:
#   1. bench/gpu_engine.py: the engine end to end on a random-weight Llama-shaped model built there
#      (batch invariance of greedy tokens and logprobs, device-fault reloads, eager decode steps);
#   2. bench/gpu_invariance.py: which step operations are batch invariant there, bit for bit;
#   3. bench/gpu_check.py: every kernel against its fp64 reference, then kernel timings (skipped past
#      --budget-s, by default CHECK_SECONDS - 40);
#   4. bench/gpu_serve.py: an 8B-shaped model (dummy weights) served at 1/16/64 streams, bf16 and int4.
# Each writes a markdown table to bench/out/ (and to $OUT when set, so a device run's files come back:
# at most 8 files, so the logs of parts 1-3 are not kept there).
# Usage: bench/gpu_check.sh [--dry-run] [--budget-s S]      (PYTHON=... to choose the interpreter)
# Hard limits of the parts, seconds (environment): ENGINE_SECONDS 120, INVARIANCE_SECONDS 60,
# CHECK_SECONDS 240, SERVE_SECONDS 150: 570 in all, inside the device tool's 600 s per call.
# On the lent H200 (its python3 has torch and triton, no network), helexa's dependencies missing there
# travel as wheels for CPython 3.12: gguf, llguidance, msgspec, pyzmq, starlette, uvicorn (downloaded
# here into an ignored .whl/, carried, and installed with --target /tmp/site onto PYTHONPATH first).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTDIR="${OUT:-bench/out}"
mkdir -p "$OUTDIR" bench/out
DRY=""
[[ " $* " == *" --dry-run "* ]] && DRY="--dry-run"
CHECK_SECONDS="${CHECK_SECONDS:-240}"
BUDGET=()
[[ " $* " == *" --budget-s "* ]] || BUDGET=(--budget-s "$((CHECK_SECONDS - 40))")
status=0

part() {  # part NAME SECONDS SCRIPT ARGS...: run one part under its limit; a failure marks the whole run
  local name="$1" seconds="$2"
  shift 2
  timeout "$seconds" "$PYTHON" "$@" 2>&1 | grep -v -E "^(INFO|DEBUG)"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && { echo "gpu_check: $name ended with status $rc" >&2; status=1; }
}

# Tensor parallelism (NCCL) on a host with two GPUs or more: TP 2 vs TP 1 greedy parity and step overhead.
GPUS="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUTDIR/gpu.txt"
  if [ "${GPUS:-0}" -ge 2 ]; then
    part "the tensor-parallel check" 240 bench/tp_overhead.py --tp 2 --device cuda --dtype float32 --repeats 20
  else
    echo "gpu_check: ${GPUS:-0} GPU(s): tensor-parallel check skipped (needs 2)"
  fi
fi
part "the engine checks" "${ENGINE_SECONDS:-120}" bench/gpu_engine.py $DRY --out "$OUTDIR/gpu_engine.md"
part "the invariance survey" "${INVARIANCE_SECONDS:-60}" bench/gpu_invariance.py $DRY --out "$OUTDIR/gpu_invariance.md"
part "the kernel checks" "$CHECK_SECONDS" bench/gpu_check.py "$@" "${BUDGET[@]}" --out "$OUTDIR/gpu_check.md"
part "the serving benchmark" "${SERVE_SECONDS:-150}" bench/gpu_serve.py $DRY --out "$OUTDIR/gpu_serve.md"
if [ "$OUTDIR" != bench/out ]; then
  cp "$OUTDIR"/gpu_*.md "$OUTDIR"/gpu_serve.png bench/out/ 2>/dev/null
fi
exit $status

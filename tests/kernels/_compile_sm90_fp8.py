"""Compile the fp8-KV variants of helexa's Triton kernels for an H200 (sm_90) without a GPU.

As `_compile_sm90.py` (whose launch-time specialisation it reuses), for caches of `*fp8e4nv` with
float32 scale pointers; prints one JSON line per case. Used by test_fp8_kv.py.
"""

from __future__ import annotations

import json
import sys

from helexa.kernels import attention, kv_write
from tests.kernels._compile_sm90 import _compile, _ptrs, _unit

# name: (q dtype, head_dim, GQA group, decode-shaped)
ATTENTION_CASES = {
    "fp8-bf16-decode-split": ("bf16", 128, 4, True),
    "fp8-bf16-prefill": ("bf16", 128, 4, False),
    "fp8-fp16-prefill": ("fp16", 128, 8, False),
    "fp8-fp32-prefill": ("fp32", 64, 4, False),
}


def main(names: list[str]) -> None:
    for name in names:
        if name in ATTENTION_CASES:
            dtype, head_dim, group, decode = ATTENTION_CASES[name]
            block_m, tile_n, num_warps, num_stages = attention._tile_config(group, head_dim)
            pointers = _ptrs(dtype, "q out") | _ptrs("fp8e4nv", "k_cache v_cache")
            pointers |= _ptrs("i32", "block_tables seq_lens query_start_loc") | _ptrs("fp32", "k_scale v_scale")
            constants = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n)
            constants |= dict(BLOCK_D=head_dim, SPLIT=decode, UPCAST=False, INTERPRETED=False)
            constants |= dict(DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
            constants |= _unit("stride_qd stride_kd stride_vd stride_od stride_btn")
            pointers |= _ptrs("fp32", "part_out part_ml")
            compiled = _compile(attention._attention_kernel, pointers, constants, num_warps, num_stages)
        elif name in ("fp8-write_kv-bf16", "fp8-write_kv-fp32"):
            dtype = name.rsplit("-", 1)[1]
            pointers = _ptrs(dtype, "k v") | _ptrs("fp8e4nv", "k_cache v_cache") | _ptrs("i64", "slot")
            pointers |= _ptrs("fp32", "k_scale v_scale")
            constants = dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128) | _unit("stride_kd stride_vd stride_kcd stride_vcd")
            compiled = _compile(kv_write._write_kv_kernel, pointers, constants, 4, 1)
        else:
            raise SystemExit(f"unknown kernel case {name!r}")
        ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
        report = dict(name=name, shared=compiled.metadata.shared, global_store="st.global" in ptx)
        report |= dict(async_copy="async_copy_global_to_local" in ttgir, wgmma="warp_group_dot" in ttgir)
        report |= dict(fp8_cvt="e4m3" in ptx)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or [*ATTENTION_CASES, "fp8-write_kv-bf16", "fp8-write_kv-fp32"])

"""Compile helexa's Triton kernels for an H200 (sm_90) without a GPU; print one JSON line per kernel.

Run as a script in a process *without* TRITON_INTERPRET (under the interpreter @triton.jit
functions are not compilable). Launch-time specialisation is reproduced: unit strides become
constants, and pointers and strides carry the divisible-by-16 hint they get from real tensors,
so the pipeliner sees what it sees on a GPU. Used by test_compile_sm90.py.
"""

from __future__ import annotations

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from helexa.kernels import attention, dense_matmul, kv_write

H200 = GPUTarget("cuda", 90, 32)


def _ptrs(dtype: str, names: str) -> dict[str, str]:
    return {f"{n}_ptr": f"*{dtype}" for n in names.split()}


def _unit(names: str) -> dict[str, int]:
    return dict.fromkeys(names.split(), 1)


def _compile(kernel, pointers: dict[str, str], constants: dict, num_warps: int, num_stages: int):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    divisible = [n for n in names if signature[n] != "constexpr" and (n in pointers or n.startswith("stride_"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=H200, options=options)


ATTENTION_CASES = {
    "bf16-decode-split": ("bf16", 128, 4, True),
    "bf16-prefill": ("bf16", 128, 4, False),
    "fp32-prefill": ("fp32", 128, 4, False),
    "fp16-d256-gqa8-prefill": ("fp16", 256, 8, False),
}


def main(names: list[str]) -> None:
    for name in names:
        if name in ATTENTION_CASES:
            dtype, head_dim, group, decode = ATTENTION_CASES[name]
            block_m, tile_n, num_warps, num_stages = attention._tile_config(group, head_dim)
            pointers = _ptrs(dtype, "q k_cache v_cache out") | _ptrs("i32", "block_tables seq_lens query_start_loc")
            constants = dict(HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n)
            constants |= dict(BLOCK_D=head_dim, SPLIT=decode, UPCAST=False, INTERPRETED=False)
            constants |= dict(DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
            constants |= _unit("stride_qd stride_kd stride_vd stride_od stride_btn")
            pointers |= _ptrs("fp32", "part_out part_ml")
            compiled = _compile(attention._attention_kernel, pointers, constants, num_warps, num_stages)
        elif name == "reduce":
            pointers = _ptrs("fp32", "part_out part_ml v_scale") | _ptrs("bf16", "out")
            constants = dict(HEAD_DIM=128, GROUP=4, BLOCK_H=64, BLOCK_D=128, KV_FP8=False, INTERPRETED=False)
            constants |= _unit("stride_od")
            compiled = _compile(attention._reduce_splits_kernel, pointers, constants, 4, 1)
        elif name == "write_kv":
            pointers = _ptrs("bf16", "k v k_cache v_cache") | _ptrs("i64", "slot")
            constants = dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128) | _unit("stride_kd stride_vd stride_kcd stride_vcd")
            compiled = _compile(kv_write._write_kv_kernel, pointers, constants, 4, 1)
        elif name in ("dense-bf16", "dense-bf16-split"):  # the model's linear layers on CUDA, default tiles
            cfg = dense_matmul.dense_config(2048 if name.endswith("split") else 16384, 2048, 132)
            pointers = _ptrs("bf16", "x w out") | _ptrs("fp32", "part")
            constants = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True)
            constants |= dict(SPLIT=cfg.split_k > 1)
            constants |= dict(UPCAST=False, DOT_PRECISION="tf32", INTERPRETED=False) | _unit("stride_xk stride_wk")
            constants |= _unit("stride_on")
            compiled = _compile(dense_matmul._dense_matmul_kernel, pointers, constants, cfg.num_warps, cfg.num_stages)
        else:
            raise SystemExit(f"unknown kernel case {name!r}")
        ttgir = compiled.asm["ttgir"]
        report = dict(name=name, shared=compiled.metadata.shared, global_store="st.global" in compiled.asm["ptx"])
        report |= dict(async_copy="async_copy_global_to_local" in ttgir, wgmma="warp_group_dot" in ttgir)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or [*ATTENTION_CASES, "reduce", "write_kv", "dense-bf16", "dense-bf16-split"])

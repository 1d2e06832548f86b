"""Compile helexa's Triton kernels for an H200 (sm_90) without a GPU; print one JSON line per kernel.

Run as a script in a process *without* TRITON_INTERPRET (under the interpreter @triton.jit
functions are not compilable). Launch-time specialisation is reproduced: unit strides become
constants, and pointers and strides carry the divisible-by-16 hint they get from real tensors,
so the pipeliner sees what it sees on a GPU. Used by test_compile_sm90.py.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H200 = GPUTarget("cuda", 90, 32)
attention = importlib.import_module("helexa.kernels.paged_attention")
write_kv = importlib.import_module("helexa.kernels.write_kv")


def _compile(kernel, pointers: dict[str, str], constants: dict, *, num_warps: int, num_stages: int):
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
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=H200,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def _report(name: str, compiled) -> None:
    ttgir = compiled.asm["ttgir"]
    print(json.dumps({
        "name": name,
        "shared": compiled.metadata.shared,
        "async_copy": "async_copy_global_to_local" in ttgir,
        "wgmma": "warp_group_dot" in ttgir,
        "global_store": "st.global" in compiled.asm["ptx"],
    }), flush=True)


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
            block_m, tile_n, num_warps, num_stages = attention._tile_config(decode, group, head_dim)
            pointers = {"q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}",
                        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                        "out_ptr": f"*{dtype}", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
            constants = dict(
                HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_m // group, TILE_N=tile_n, BLOCK_D=head_dim,
                SPLIT=decode, UPCAST=False, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", INTERPRETED=False,
                stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_btn=1,
            )
            _report(name, _compile(attention._attention_kernel, pointers, constants,
                                   num_warps=num_warps, num_stages=num_stages))
        elif name == "reduce":
            _report(name, _compile(
                attention._reduce_splits_kernel,
                {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"},
                dict(HEAD_DIM=128, SPLITS_PAD=32, BLOCK_H=2, BLOCK_D=128, stride_od=1), num_warps=4, num_stages=1,
            ))
        elif name == "write_kv":
            _report(name, _compile(
                write_kv._write_kv_kernel,
                {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "slot_ptr": "*i64"},
                dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, stride_kd=1, stride_vd=1, stride_kcd=1, stride_vcd=1),
                num_warps=4, num_stages=1,
            ))
        else:
            raise SystemExit(f"unknown kernel case {name!r}")


if __name__ == "__main__":
    main(sys.argv[1:] or [*ATTENTION_CASES, "reduce", "write_kv"])

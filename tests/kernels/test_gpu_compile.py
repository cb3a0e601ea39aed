"""The MoE's Triton kernels, the linear layers' matmul, and the attention kernels' forms for a mixed steps' CUDA
graph (early exits past the step's counts), compiled for an H100/H200 (sm_90, bf16, the launches' constants) on any
machine, GPU or not: the CPU tests run them in Triton's interpreter, which accepts code the GPU compiler refuses (the
pair kernels' first `tl.dot` form passed the interpreter and failed to compile on the GPU, and the matmul's first
grouped order read a global: results/HISTORY.md). The compiler runs in a process of its own, without
TRITON_INTERPRET (under it, `triton.jit` makes interpreted functions)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.kernels

POINTERS = {"ids_ptr": "*i64", "pairs_ptr": "*i64", "block_expert_ptr": "*i64", "counters_ptr": "*i32",
            "counts_ptr": "*i32", "table_ptr": "*i32", "context_lens_ptr": "*i32", "arrivals_ptr": "*i32",
            "shared_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32",
            "shared_o_ptr": "*fp32", "shared_lse_ptr": "*fp32", "partials_ptr": "*fp32",
            "slots_ptr": "*i64", "starts_ptr": "*i32", "rows_ptr": "*i32", "ends_ptr": "*i32"}  # every other: bf16
SCALARS = {"scale_log2": "fp32", "eps": "fp32"}  # every other scalar: i32
H100_SHARED = 232448  # the shared memory a block may have on an H100 or H200 (bytes): what a launch must fit


def kernels() -> list[tuple[object, dict[str, object]]]:
    """(kernel, its constexprs, its warps and stages) as weft.layers.moe launches them for the Qwen3-30B-A3B shape (E
    2048, 128 experts, top 8), the attention kernels counted, for Qwen3-0.6B's heads (16 and 8 of 128), and the
    linear layers' matmul: whole K in a loop per chunk with the widest tile in steps of 64 (its operands read by
    pointers and by tensor descriptors), split, and split with RoPE after it (heads of 128); the prefill's launches
    with 16-bit tiles three stages deep, of 128 rows and of a small grid's 64; the batch-invariant attention's programs
    for generated tokens and for prompt tokens."""
    from weft.attention.kernels import decode, prefill
    from weft.layers import linear, moe

    def pair(launch: moe.PairLaunch, **constexprs: object) -> dict[str, object]:
        return dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, num_warps=launch.num_warps, PDL=True, **constexprs)

    route = dict(TOP_K=8, TOP_K_P2=8, BLOCK=128, NORM=True, PDL=True)
    grouped = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, PRECISION="tf32")
    grouping = dict(EXPERTS_P2=128, CHUNK=moe.GROUP_CHUNK, TILE=moe.GROUP_TILE)
    split = dict(decode._constexprs(16, 8, 128, 16, decode.SHALLOW_TILES, 0, False, True), PDL=True)
    counted_prefill = dict(GROUP=2, D=128, D_PAD=128, P=16, BLOCK_M=prefill.BLOCK_M, BLOCK_N=64, WINDOW=0,
                           COUNTED=True, num_warps=prefill.NUM_WARPS, num_stages=prefill.NUM_STAGES)
    matmul = dict(CHUNKED=True, HAS_BIAS=False, EVEN_K=True, GATED=False, GROUP_M=linear.GROUP_M, PDL=True)
    wide, small = linear.Tiles(128, 256, 8, 3, 64), linear.DECODE_TILES
    return [
        *((linear._matmul_kernel, dict(matmul, NESTED=True, SPLIT_GRID=False, BLOCK_M=wide.block_m,
                                       BLOCK_N=wide.block_n, BLOCK_K=wide.block_k, TMA=tma, num_warps=wide.num_warps,
                                       num_stages=wide.num_stages)) for tma in (False, True)),
        (linear._matmul_kernel, dict(matmul, NESTED=False, SPLIT_GRID=True, BLOCK_M=small.block_m,
                                     BLOCK_N=small.block_n, BLOCK_K=small.block_k, TMA=False, num_warps=small.num_warps,
                                     num_stages=small.num_stages)),
        (linear._rope_kernel, dict(HAS_BIAS=True, EVEN_K=True, NORM=True, BLOCK_M=linear.DECODE_ROWS, D=128,
                                   BLOCK_K=linear.BLOCK_K, PDL=True, num_warps=4, num_stages=4)),
        (moe._pair_gate_up_kernel, pair(moe.PAIR_GATE_UP)),
        (moe._pair_down_kernel, pair(moe.PAIR_DOWN, TOP_K=8)),
        (moe._router_kernel, dict(route, ROWS=moe.ROUTER_ROWS, BLOCK_K=moe.ROUTER_BLOCK_K)),
        (moe._route_kernel, route),
        (moe._gate_up_kernel, grouped),
        (moe._down_kernel, grouped),
        (moe._count_kernel, grouping),
        (moe._group_kernel, dict(grouping, BLOCK_M=64, COUNTED=False)),
        (moe._group_kernel, dict(grouping, BLOCK_M=64, COUNTED=True)),
        (decode._split_kernel, split),
        (prefill._prefill_kernel, counted_prefill),
        *((prefill._prefill_kernel, dict(counted_prefill, BLOCK_M=block_m, BLOCK_N=128, num_warps=warps,
                                         num_stages=prefill.DEEP_STAGES))
          for block_m, warps in ((prefill.BLOCK_M, prefill.NUM_WARPS),
                                 (prefill.SMALL_BLOCK_M, prefill.SMALL_NUM_WARPS))),
        *((prefill._grouped_kernel, dict(GROUP=2, D=128, D_PAD=128, P=16, BLOCK_M=prefill.grouped_rows(2, 2, prompt),
                                         BLOCK_N=decode.SHALLOW_TILES.block_n, WINDOW=0, SEARCH=prefill.SEARCH, H_KV=8,
                                         num_warps=decode.NUM_WARPS, num_stages=decode.SHALLOW_TILES.num_stages))
          for prompt in (False, True)),
    ]


def compile_all() -> None:
    """Compile each of `kernels()` to a cubin for sm_90; print one line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, launch in kernels():
        constants = {k: v for k, v in launch.items() if k not in ("num_warps", "num_stages")}
        options = {k: v for k, v in launch.items() if k in ("num_warps", "num_stages")}
        signature = {p.name: "constexpr" if p.is_constexpr else POINTERS.get(p.name, "*bf16")
                     if p.name.endswith("_ptr") else SCALARS.get(p.name, "i32") for p in kernel.params}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options=dict(enable_fp_fusion=False, **options))
        assert compiled.asm.get("cubin"), kernel.fn.__name__
        assert compiled.metadata.shared <= H100_SHARED, (kernel.fn.__name__, compiled.metadata.shared)
        print(kernel.fn.__name__, constants, "compiled")


def test_kernels_compile_for_the_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("compiled") == len(kernels()), run.stdout


if __name__ == "__main__":
    compile_all()

"""Tune the decode GEMMs of weft.layers.linear on this GPU: for each weight shape of the given models, time every
candidate launch (TILES x splits) at 1 and DECODE_ROWS rows, keep the fastest, and beside cuBLAS at 1 .. DECODE_ROWS
rows find the most rows it is at least as fast at (MARGIN). A shape where cuBLAS wins at one row gets no entry (its
layer keeps cuBLAS). An MLP's gate_up is tuned gated: SiLU x up in the launch, against cuBLAS and the SiLU x up kernel.

    python -m weft.benchmark.tune_gemm [--models qwen3-0.6b ...] [--invariant] [--write]

Timings are GPU time alone, replayed from a CUDA graph over copies of the weight that together outgrow the L2 (a
decode step's layers each read their own weights from memory). --write puts the table in TUNED under this GPU's
name, the dtype and its section; the printed lines are the log to keep beside it.

With --invariant it tunes the batch-invariant kernel instead (EngineConfig.deterministic): for each weight shape the
count of chunks K is summed in, and at each of INVARIANT_ROWS the fastest of INVARIANT_TILES, whole or split, whatever
cuBLAS does (printed beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from weft.benchmark.environment import copy_bandwidth_gbps, device_name, git_sha, graph_seconds
from weft.config import ModelConfig
from weft.inference.config import DTYPES
from weft.layers.fused import silu_and_mul
from weft.layers.linear import (
    BLOCK_K,
    COUNTERS,
    DECODE_ROWS,
    DECODE_TILES,
    INVARIANT_ROWS,
    TUNED,
    DecodeLaunch,
    MatmulPlan,
    Tiles,
    chunks,
    decode_matmul,
    matmul_kernel,
    rule_of_thumb,
)
from weft.models.loader import resolve_model

MODELS = ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "llama-3.1-8b")
# (block_n, block_k, num_warps, num_stages): narrow tiles for many programs, deep pipelines for bytes in flight
TILES = [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
         (64, 128, 4, 4), (64, 128, 4, 5), (64, 256, 4, 3), (64, 256, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3),
         (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3)]
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
MOST_PROGRAMS = 2048  # split grids past this many programs are not tried (and COUNTERS bounds the tiles)
ROWS = (1, 2, 4, 8, DECODE_ROWS)  # the row counts compared with cuBLAS (a decode graph's batch sizes)
# a tuned launch replaces cuBLAS where it takes at most this share of cuBLAS's time, ties included: on a GPU with
# programmatic dependent launch (weft.layers.fused.dependent_launch) it also lets the kernel after it start early,
# which a cuBLAS launch does not, and a timing of one launch alone cannot show it (repeated timings of one launch
# differ by up to 5%: results/logs/h200_tune_gemm_f499d27.log)
MARGIN = 1.0
VERIFY_ROUNDS = 21  # the comparison's replays (the search's: 5)
# the batch-invariant kernel's candidates: rows in whole warpgroups of 64; steps of 64 for the widest tiles, whose
# steps of 128 outgrow shared memory, and for deeper pipelines; the wide ones also with their operands read by TMA;
# and at up to DECODE_ROWS rows the decode launches' row tiles, which run another MMA instruction (mma.sync, not
# wgmma): kept only where they give the same bits, which is not known before a GPU says so
INVARIANT_TILES = [
    *(Tiles(*t) for t in ((64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3),
                          (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3))),
    *(Tiles(*t, block_k=64) for t in ((64, 128, 4, 4), (64, 256, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4),
                                      (128, 256, 8, 3), (128, 256, 8, 4))),
    *(Tiles(*t, tma=True) for t in ((64, 64, 4, 3, 128), (128, 128, 8, 3, 128), (64, 128, 4, 4, 64),
                                    (128, 128, 8, 4, 64), (128, 256, 8, 3, 64), (128, 256, 8, 4, 64))),
    *(Tiles(DECODE_ROWS, n, 4, 4) for n in (32, 64, 128)),
]
# the batch-invariant kernel's counts of chunks tried: on Qwen3-0.6B's and 4B's shapes none past 3 won
# (results/logs/h100_tune_gemm_invariant_plans_a9e4f4a.log)
INVARIANT_SPLITS = (1, 2, 3, 4, 6, 8)
SPLIT_ROWS = 256  # past these rows a split's float32 partials cost more than its programs gain: not tried
LOGIT_ROWS = 256  # EngineConfig.max_num_seqs's default: the most rows the LM head computes
ROTATION_BYTES = 256 << 20  # weight bytes cycled through per timing: several times the H200's L2


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each linear layer's weight in one rank's whole model (a mixture of experts' router, and
    the dense MLP's only where some layer has one)."""
    shapes = dict(qkv=((cfg.H_q + 2 * cfg.H_kv) * cfg.D, cfg.E), o=(cfg.E, cfg.H_q * cfg.D))
    if cfg.moe is None or len(cfg.moe.layers) < cfg.L:
        shapes.update(gate_up=(2 * cfg.intermediate, cfg.E), down=(cfg.E, cfg.intermediate))
    if cfg.moe is not None:
        shapes.update(router=(cfg.moe.num_experts, cfg.E))
    return dict(shapes, lm_head=(cfg.V, cfg.E))


class Shape:
    """One weight shape's copies and rows, and the timings of launches over them."""

    def __init__(self, N: int, K: int, dtype: torch.dtype, rows: int = DECODE_ROWS) -> None:
        self.N, self.K = N, K
        copies = max(1, -(-ROTATION_BYTES // (N * K * dtype.itemsize)))
        self.weights = [torch.randn(N, K, device="cuda", dtype=dtype) * K**-0.5 for _ in range(copies)]
        self.x = torch.randn(rows, K, device="cuda", dtype=dtype)
        self.bytes = N * K * dtype.itemsize

    def triton_s(self, launch: DecodeLaunch, M: int, rounds: int = 5, gated: bool = False) -> float:
        x = self.x[:M]
        return graph_seconds([lambda w=w: decode_matmul(x, w, None, launch, gated) for w in self.weights], rounds)

    def invariant_s(self, tiles: Tiles, split: bool, M: int, order: MatmulPlan) -> float:
        x = self.x[:M]
        return graph_seconds([lambda w=w: matmul_kernel(x, w, None, split, tiles, order) for w in self.weights])

    def cublas_s(self, M: int, rounds: int = 5, gated: bool = False) -> float:
        """cuBLAS's product (gated: then weft.layers.fused's SiLU x up)."""
        x = self.x[:M]
        if gated:
            return graph_seconds([lambda w=w: silu_and_mul(F.linear(x, w)) for w in self.weights], rounds)
        return graph_seconds([lambda w=w: F.linear(x, w) for w in self.weights], rounds)

    def candidates(self, gated: bool = False) -> list[DecodeLaunch]:
        """Every tile of TILES with each count of splits that gives distinct chunks and not too many programs."""
        out = []
        for block_n, block_k, warps, stages in TILES:
            n_tiles = -(-(self.N // 2 if gated else self.N) // block_n)
            seen = set()
            for want in SPLITS:
                splits = chunks(self.K, block_k, want).splits
                if splits in seen or (splits > 1 and n_tiles * splits > MOST_PROGRAMS):
                    continue
                seen.add(splits)
                out.append(DecodeLaunch(Tiles(DECODE_ROWS, block_n, warps, stages, block_k), splits, DECODE_ROWS))
        return out


def tune(N: int, K: int, dtype: torch.dtype, copy_gbps: float, gated: bool = False) -> DecodeLaunch | None:
    """The fastest candidate for (N, K), with the most rows it beats cuBLAS at; None if cuBLAS wins at one row.
    `gated`: an MLP's gate and up, SiLU x up in the launch against cuBLAS and weft.layers.fused's SiLU x up after
    it. (A bias is added after the sums, and costs the same in both.)"""
    shape = Shape(N, K, dtype)
    floor = shape.bytes / (copy_gbps * 1e9)
    timed = []
    for launch in shape.candidates(gated):
        t1, t16 = shape.triton_s(launch, 1, gated=gated), shape.triton_s(launch, DECODE_ROWS, gated=gated)
        timed.append((t1 + t16, launch))
        t = launch.tiles
        print(f"  {N}x{K} {t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"
              f" splits={launch.splits}: M=1 {t1 * 1e6:.1f} us ({floor / t1:.0%} of copy), M={DECODE_ROWS} "
              f"{t16 * 1e6:.1f} us", flush=True)
    best = min(timed, key=lambda t: t[0])[1]
    max_rows = 0
    for M in ROWS:
        ours, theirs = shape.triton_s(best, M, VERIFY_ROUNDS, gated), shape.cublas_s(M, VERIFY_ROUNDS, gated)
        print(f"= {N}x{K} M={M}: tuned {ours * 1e6:.1f} us ({floor / ours:.0%} of copy), cuBLAS {theirs * 1e6:.1f} us "
              f"({floor / theirs:.0%}), {theirs / ours:.2f}x", flush=True)
        if ours > MARGIN * theirs:
            break
        max_rows = M
    del shape
    torch.cuda.empty_cache()
    return DecodeLaunch(best.tiles, best.splits, max_rows) if max_rows else None


def invariant_orders(N: int, K: int) -> list[MatmulPlan]:
    """The chunks of K the tuner tries for an [N, K] weight, fewest first: K whole, in each count of INVARIANT_SPLITS
    whose chunks hold two BLOCK_K steps or more, and in `rule_of_thumb`'s."""
    steps = -(-K // BLOCK_K)
    orders = {chunks(K, BLOCK_K, want) for want in INVARIANT_SPLITS if want == 1 or want <= steps // 2}
    return sorted(orders | {rule_of_thumb(N, K)}, key=lambda p: p.splits)


def fastest_invariant(shape: Shape, order: MatmulPlan, M: int) -> tuple[float, Tiles, bool]:
    """The fastest of INVARIANT_TILES, each whole and split into `order`'s chunks, at M rows of `shape`'s weight:
    only those whose bits are the small tiles' whole launch's (any tile of either step should give them on the GPU:
    one that did not would be reported and left out)."""
    x, w = shape.x[:M], shape.weights[0]
    want = matmul_kernel(x, w, None, False, DECODE_TILES, order)
    timed = []
    for tiles in INVARIANT_TILES:
        if tiles.block_m == DECODE_ROWS < M:
            continue  # a decode's row tile, for more rows than a decode's
        for split in (False, True) if order.splits > 1 and M <= SPLIT_ROWS else (False,):
            if split and -(-M // tiles.block_m) * -(-shape.N // tiles.block_n) > COUNTERS:
                continue  # an arrival counter per tile
            try:
                same = torch.equal(matmul_kernel(x, w, None, split, tiles, order), want)
            except OutOfResources:
                continue
            if not same:
                print(f"  {shape.N}x{shape.K} M={M} splits={order.splits} {tiles} split={split}: NOT the same bits, "
                      "left out", flush=True)
                continue
            timed.append((shape.invariant_s(tiles, split, M, order), tiles, split))
    if not timed:
        raise RuntimeError(f"{shape.N}x{shape.K} M={M}: no candidate fits the GPU and keeps the bits")
    return min(timed, key=lambda t: t[0])


def tune_invariant(N: int, K: int, dtype: torch.dtype, most_rows: int) -> dict:
    """The batch-invariant kernel's chunks of K for an [N, K] weight and its fastest launch at each of INVARIANT_ROWS
    up to `most_rows`. Of `invariant_orders`, the one kept is the one whose fastest launches take the least time
    relative to the fastest of any at each row count (the mean of those ratios: a decode's few rows and a prefill's
    many weigh alike). A table entry: {"splits": .., "rows": {rows: tiles and split}}."""
    rows = [r for r in INVARIANT_ROWS if r <= most_rows]
    shape = Shape(N, K, dtype, rows[-1])
    orders = invariant_orders(N, K)
    best = {p: {} for p in orders}
    for M in rows:
        for p in orders:
            best[p][M] = fastest_invariant(shape, p, M)
        print(f"  {N}x{K} M={M}: " + " | ".join(
            f"splits={p.splits} {best[p][M][0] * 1e6:.1f} us" for p in orders), flush=True)
    least = {M: min(best[p][M][0] for p in orders) for M in rows}
    cost = {p: statistics.mean(best[p][M][0] / least[M] for M in rows) for p in orders}
    chosen = min(orders, key=cost.__getitem__)
    print(f"  {N}x{K}: mean time over the fastest, by splits: " + ", ".join(
        f"{p.splits}: {cost[p]:.3f}" for p in orders) + f"; rule of thumb {rule_of_thumb(N, K).splits}, "
        f"chosen {chosen.splits}", flush=True)
    out = {}
    for M in rows:
        seconds, tiles, split = best[chosen][M]
        cublas = shape.cublas_s(M)
        rule = best[rule_of_thumb(N, K)][M][0]
        print(f"= {N}x{K} M={M}: splits={chosen.splits} {tiles} split={split} {seconds * 1e6:.1f} us, rule of "
              f"thumb's splits {rule * 1e6:.1f} us, cuBLAS {cublas * 1e6:.1f} us, {seconds / cublas:.2f}x cuBLAS's "
              "time", flush=True)
        out[str(M)] = dict(asdict(tiles), split=split)
    del shape
    torch.cuda.empty_cache()
    return dict(splits=chosen.splits, rows=out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--invariant", action="store_true",
                        help="tune the batch-invariant kernel's launches (deterministic=True) instead of the decode's")
    parser.add_argument("--write", action="store_true", help=f"write the section into {TUNED}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemm needs a CUDA GPU")
    dtype, gpu, copy_gbps = DTYPES[args.dtype], device_name("cuda"), copy_bandwidth_gbps()
    print(f"# {'invariant' if args.invariant else 'decode'}: {gpu}, {args.dtype}, commit {git_sha()}, copy "
          f"{copy_gbps:.0f} GB/s (read + written)", flush=True)
    names = ["invariant"] if args.invariant else ["decode", "gated"]
    sections: dict[str, dict[str, dict | None]] = {name: {} for name in names}
    for model in args.models:
        cfg = resolve_model(model).config
        for name, (N, K) in layer_shapes(cfg).items():
            # the MLP's gate_up runs with SiLU x up after it: its decode launches are the gated ones
            section = "invariant" if args.invariant else "gated" if name == "gate_up" else "decode"
            key = f"{N}x{K}"
            if key in sections[section]:
                continue
            print(f"# {model} {name} N={N} K={K}", flush=True)
            if args.invariant:  # the LM head computes only the rows that need logits: at most max_num_seqs
                sections[section][key] = tune_invariant(N, K, dtype,
                                                        LOGIT_ROWS if name == "lm_head" else INVARIANT_ROWS[-1])
            else:
                launch = tune(N, K, dtype, copy_gbps, gated=section == "gated")
                sections[section][key] = launch.record() if launch else None
    print(json.dumps(sections, indent=1))
    if args.write:  # the shapes tuned now replace their entries (or, where cuBLAS won, drop them); the others stay
        data = json.loads(TUNED.read_text())
        for section, table in sections.items():
            entries = data.setdefault(gpu, {}).setdefault(args.dtype, {}).setdefault(section, {})
            for key, entry in table.items():
                if entry is None:
                    entries.pop(key, None)
                else:
                    entries[key] = entry
        TUNED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

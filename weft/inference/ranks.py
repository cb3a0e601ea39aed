"""Tensor-parallel ranks: the group an engine's ranks meet in, and what every rank builds alike.

`build_rank` makes a rank's slice of the model, its share of the pool (its K/V heads) and its runner with
its CUDA graphs, for rank 0 (the engine, which alone schedules and samples) and the others alike.
`RankGroup` starts ranks 1..size-1, each a process of its own that builds its rank and then runs every
step rank 0 sends it, and stops them. The group is torch.distributed's on 127.0.0.1: NCCL on CUDA (rank r
on GPU r, NVLink multicast off), gloo on the CPU. A group of size 1 starts nothing and joins nothing.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from weft.config import ModelConfig
from weft.distributed import TensorParallel
from weft.inference.config import EngineConfig
from weft.inference.cuda_graphs import DecodeGraphs, MixedGraphs, PiecewiseGraphs
from weft.inference.pool import PoolPlan, plan_pool
from weft.inference.runner import ModelRunner
from weft.inference.sampling import SamplingState
from weft.layers import linear
from weft.models import build_model
from weft.models.llama import LlamaForCausalLM
from weft.models.loader import ModelSource, resolve_model

JOIN_TIMEOUT = timedelta(seconds=120)  # a rank that has not joined by then has failed to start


@dataclass
class RankGroup:
    """The `size` ranks of one engine and the port they meet at; rank 0's object also holds the processes of
    ranks 1..size-1."""

    size: int
    port: int = 0  # 0: a group of one, which never meets
    processes: list[multiprocessing.Process] = field(default_factory=list)  # ranks 1..size-1 (rank 0's object)

    @classmethod
    def start(cls, config: EngineConfig) -> RankGroup:
        """Rank 0's group for `config`: ranks 1..size-1 start now, each building its rank while rank 0 builds
        its own, and wait for rank 0 in the group (`join`) and for its pool's size (`share_pool`)."""
        group = cls(config.tensor_parallel_size)
        if group.size == 1:
            return group
        group.port = _free_port()
        ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's CUDA state
        group.processes = [ctx.Process(target=_follow, args=(config, rank, group.port), daemon=True,
                                     name=f"weft-tp-rank{rank}") for rank in range(1, group.size)]
        for p in group.processes:
            p.start()
        return group

    def join(self, tp: TensorParallel, device: torch.device) -> None:
        """This process joins the group as rank tp.rank (every rank must, before any collective)."""
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{self.port}", rank=tp.rank, world_size=self.size,
                                timeout=JOIN_TIMEOUT)

    @staticmethod
    def share_pool(pool: PoolPlan | None, device: torch.device) -> int:
        """Rank 0's pool size (`pool`; None on the others), sent to every rank: each pool holds as many blocks,
        of its own K/V heads."""
        n = torch.tensor([pool.num_blocks if pool is not None else 0], device=device)
        dist.broadcast(n, 0)
        return int(n.item())

    def stop(self, runner: ModelRunner) -> None:
        """Rank 0: the other ranks leave their loop and exit; then the group is gone."""
        if self.size == 1:
            return
        runner.stop_ranks()
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        dist.destroy_process_group()


def build_rank(config: EngineConfig, source: ModelSource, rank: int, group: RankGroup) -> tuple[ModelRunner, PoolPlan]:
    """Rank `rank`'s runner and pool: its slice of the model, its weights read tensor by tensor (no rank holds the
    whole model), then its pool, which rank 0 sizes (on CUDA from what its weights leave free) and the others
    take the size of, then its CUDA graphs."""
    tp = TensorParallel(rank, group.size)
    device = config.device if rank == 0 or config.device.type != "cuda" else torch.device("cuda", rank)
    model = _load_slice(config, source, tp, device)
    local = tp.local(source.config)
    pool = plan_pool(config, local) if rank == 0 else None
    if group.size > 1:
        group.join(tp, device)
        num_blocks = group.share_pool(pool, device)
        pool = pool or plan_pool(replace(config, num_blocks=num_blocks), local)
    return _runner(config, local, model, pool, tp, device, source.eos_token_ids), pool


def _load_slice(config: EngineConfig, source: ModelSource, tp: TensorParallel, device: torch.device
                ) -> LlamaForCausalLM:
    model = build_model(source.config, config.torch_dtype, device, tp)
    source.load_into(model)
    model.use_kernels(config.enable_fused_layers, config.enable_tuned_gemms)
    model.use_batch_invariant(config.deterministic)
    linear.prepare(model, device, config.max_num_batched_tokens)
    return model


def _runner(config: EngineConfig, local: ModelConfig, model: LlamaForCausalLM, pool: PoolPlan, tp: TensorParallel,
            device: torch.device, eos_token_ids: frozenset[int]) -> ModelRunner:
    """The runner over this rank's pool and, on CUDA, its graphs (decode graphs where the backend's attention can
    be captured)."""
    attn = config.backend(local, pool.num_blocks, pool.block_size, config.torch_dtype, device)
    attn.batch_invariant = config.deterministic
    mode = config.cudagraph_mode if device.type == "cuda" else "NONE"
    graphs = mixed = pieces = None
    if mode.startswith("FULL") and attn.cuda_graphs:
        graphs = DecodeGraphs(model, attn, config.max_num_seqs, config.max_model_len)
    if mode == "FULL_AND_PIECEWISE" and attn.counts_steps:
        mixed = MixedGraphs(model, attn, config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len)
    if mode.endswith("PIECEWISE"):
        pieces = PiecewiseGraphs(model, attn, config.max_num_batched_tokens)
    sampling = SamplingState(model.cfg.V, device, config.max_num_seqs, eos_token_ids) if tp.rank == 0 else None
    return ModelRunner(model, attn, device, graphs, pieces, tp, sampling, mixed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _follow(config: EngineConfig, rank: int, port: int) -> None:
    """Rank `rank`'s process: build the rank, then run every step rank 0 sends until it sends none."""
    if config.device.type == "cuda":
        torch.cuda.set_device(rank)
    runner, _ = build_rank(config, resolve_model(config.model), rank, RankGroup(config.tensor_parallel_size, port))
    runner.follow()
    dist.destroy_process_group()

"""Tensor-parallel ranks: what every rank builds alike (its slice of the model, its share of the pool, its
CUDA graphs), the process group they meet in, and the workers, ranks 1..size-1, each a process of its own
that runs every step rank 0 (the engine, which alone schedules and samples) sends it.

The group is torch.distributed's on 127.0.0.1: NCCL on CUDA (rank r on GPU r, NVLink multicast off), gloo
on the CPU.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from weft.distributed import TensorParallel
from weft.inference.config import EngineConfig
from weft.inference.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from weft.inference.pool import PoolPlan, plan_pool
from weft.inference.runner import ModelRunner
from weft.models import build_model
from weft.models.llama import LlamaForCausalLM
from weft.models.loader import ModelSource, resolve_model

JOIN_TIMEOUT = timedelta(seconds=120)  # a rank that has not joined by then has failed to start


def load_slice(config: EngineConfig, source: ModelSource, tp: TensorParallel, device: torch.device) -> LlamaForCausalLM:
    """This rank's slice of the model, its weights read tensor by tensor (no rank holds the whole model)."""
    model = build_model(source.config, config.torch_dtype, device, tp)
    source.load_into(model)
    model.use_kernels(config.enable_fused_layers)
    return model


def make_runner(config: EngineConfig, source: ModelSource, model: LlamaForCausalLM, pool: PoolPlan,
                tp: TensorParallel, device: torch.device) -> ModelRunner:
    """The runner over this rank's share of the pool (its K/V heads) and, on CUDA, its graphs (decode graphs
    where the backend's attention can be captured)."""
    attn = config.backend(tp.local(source.config), pool.num_blocks, pool.block_size, config.torch_dtype, device)
    mode = config.cudagraph_mode if device.type == "cuda" else "NONE"
    graphs = pieces = None
    if mode.startswith("FULL") and attn.cuda_graphs:
        graphs = DecodeGraphs(model, attn, config.max_num_seqs, config.max_model_len)
    if mode.endswith("PIECEWISE"):
        pieces = PiecewiseGraphs(model, attn, config.max_num_batched_tokens)
    return ModelRunner(model, attn, device, graphs, pieces, tp)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(tp: TensorParallel, port: int, device: torch.device) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=tp.rank, world_size=tp.size, timeout=JOIN_TIMEOUT)


def start_workers(config: EngineConfig, port: int) -> list[multiprocessing.Process]:
    """Ranks 1..size-1 of `config`: each loads its slice while rank 0 loads its own, then waits for rank 0 in
    the group at `port` and for its pool plan (`share_pool`)."""
    ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's CUDA state
    workers = [ctx.Process(target=_work, args=(config, rank, port), daemon=True, name=f"weft-tp-rank{rank}")
               for rank in range(1, config.tensor_parallel_size)]
    for w in workers:
        w.start()
    return workers


def share_pool(pool: PoolPlan | None, device: torch.device) -> int:
    """Rank 0's pool size, sent to every rank (`pool` None on the others): every rank's pool holds as many
    blocks, of its own K/V heads."""
    n = torch.tensor([pool.num_blocks if pool is not None else 0], device=device)
    dist.broadcast(n, 0)
    return int(n.item())


def stop_workers(runner: ModelRunner, workers: list[multiprocessing.Process]) -> None:
    """Rank 0: the workers leave their loop and exit; then the group is gone."""
    runner.stop_workers()
    for w in workers:
        w.join(timeout=30)
        if w.is_alive():
            w.terminate()
    dist.destroy_process_group()


def _work(config: EngineConfig, rank: int, port: int) -> None:
    tp = TensorParallel(rank, config.tensor_parallel_size)
    device = torch.device("cuda", rank) if config.device.type == "cuda" else config.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = resolve_model(config.model)
    model = load_slice(config, source, tp, device)
    join_group(tp, port, device)
    config = replace(config, num_blocks=share_pool(None, device))
    pool = plan_pool(config, tp.local(source.config))
    make_runner(config, source, model, pool, tp, device).follow()
    dist.destroy_process_group()

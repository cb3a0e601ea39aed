"""e15: model families (issue 35's targets), random weights. Parts, each selectable with -k:

- moe_sweep: the mixture of experts (the Qwen3-30B-A3B shape) on e2's workload at each of e15_batches, weft
  (continuous x the configured backend) beside HF `generate` (eager), in the same run.
- moe_standard: the mixture of experts on e8's workload, weft beside HF `generate_batch` (its continuous batching).
- batch1_itl: the MoE and the dense families (Llama-3.1-8B, Qwen3-8B shapes) on e12's batch-1 request, weft only,
  each with its weights floor per step: the bytes a decode step reads (of the MoE, the experts its token is routed
  to), at the copy bandwidth measured in the same run.
- moe_kernels: one MoE layer's expert kernels (gate_up, then down) over each of e15_kernel_tokens' counts of random
  tokens routed by the layer's router, against the bytes they must move, as a fraction of the copy bandwidth: at
  batch 1 the pair kernels (a program per (token, expert) pair), at 256 tokens the kernels over pairs grouped by
  expert; GPU time replayed from a CUDA graph over several routings. Without a GPU they run once at toy sizes in
  Triton's interpreter, timed by the host clock, only so that the code cannot rot.

The models are large (the MoE is 61 GB in bf16, and weft copies it into its own): each test takes its model `alone`,
so no two sit in memory at once; the MoE's tests come first and share one build.
"""

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

from weft.benchmark import workloads
from weft.benchmark.environment import graph_seconds, kernel_environment, launched_seconds
from weft.benchmark.floor import step_weights
from weft.benchmark.runner import BenchConfig
from weft.inference.config import DTYPES
from weft.layers.moe import (
    SparseMoE,
    expert_kernels,
    experts_reference,
    fused_experts,
    kernel_groups,
    pair_experts,
    runs_pairs,
)
from weft.models.loader import resolve_model

pytestmark = pytest.mark.perf

COPIES = 8  # routings replayed in one graph on a GPU: together they read most of the experts, beyond the L2
CHECKED_TOKENS = 8  # the kernels' first tokens checked against the PyTorch reference (which gathers weights per pair)


@pytest.mark.parametrize("engine", ["weft", "hf_generate"])
def test_e15_moe_sweep(run_benchmark, sizes, model_for, device, e15_batch, engine):
    hf = model_for(sizes.e15_moe_model, sizes.dtype, alone=True)
    workload = workloads.fixed(e15_batch, sizes.e2_prompt_len, sizes.e2_new_tokens, hf.config.vocab_size)
    config = BenchConfig(options=dict(attention=sizes.attention)) if engine == "weft" else BenchConfig(engine=engine)
    run_benchmark("e15", config, workload, model=sizes.e15_moe_model, S=sizes.e2_prompt_len, B=e15_batch,
                  **step_weights(hf, e15_batch, device))


@pytest.mark.parametrize("engine", ["weft", "hf_generate_batch"])
def test_e15_moe_standard(run_benchmark, sizes, model_for, engine):
    hf = model_for(sizes.e15_moe_model, sizes.dtype, alone=True)
    workload = workloads.standard(hf.config.vocab_size, sizes.e8_requests, sizes.e8_lengths)
    # beside HF's copy of the weights, weft's pool at 3/4 of what every request at once would need (the whole, 26.6
    # GiB, does not fit an H200), and its prompts prefilled in chunks of e15_e8_budget tokens (the benchmark's default,
    # every prompt in one step, would need the activations of 147k tokens)
    options = dict(attention=sizes.attention, max_num_batched_tokens=sizes.e15_e8_budget)
    config = BenchConfig(options=options, pool_fraction=0.75) if engine == "weft" else BenchConfig(engine=engine)
    run_benchmark("e15_e8", config, workload, model=sizes.e15_moe_model)


def test_e15_batch1_itl(run_benchmark, sizes, model_for, device, e15_itl_model):
    hf = model_for(e15_itl_model, sizes.dtype, alone=True)
    workload = workloads.fixed(1, sizes.e12_prompt_len, sizes.e12_new_tokens, hf.config.vocab_size)
    config = BenchConfig(options=dict(attention=sizes.attention))
    run_benchmark("e15_itl", config, workload, model=e15_itl_model, S=sizes.e12_prompt_len, B=1,
                  **step_weights(hf, 1, device))


def expert_passes(layer: SparseMoE, x: torch.Tensor, top_k: int, num_experts: int) -> tuple[Callable, Callable]:
    """x [T, E]'s expert pass as SparseMoE runs it (few pairs: `pair_experts`, which sums each token's pairs; more:
    grouped by expert beforehand, [T * top_k, E] each pair's), and beside it the whole pass with the grouping."""
    weights, ids = layer.route(x)
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    if runs_pairs(x.shape[0], top_k, x.shape[1]):
        kernels = functools.partial(pair_experts, x, gate_up, down, weights, ids)
        return kernels, kernels
    return (functools.partial(expert_kernels, x, gate_up, down, weights, *kernel_groups(ids, num_experts)),
            functools.partial(fused_experts, x, gate_up, down, weights, ids))


def test_e15_moe_kernels(benchmark, sizes, device, e15_kernel_tokens):
    """The gate_up and down kernels of one layer of e15_moe_model over T routed tokens as SparseMoE runs them: few
    pairs by `pair_experts`, more grouped by expert beforehand; beside them, the layer's whole expert pass with the
    grouping (`fused_experts`), where there is one. On a GPU, COPIES sets of tokens (each routed to its own experts,
    as a step's layers each read their own) replayed from one CUDA graph."""
    cfg, dtype, T = resolve_model(sizes.e15_moe_model).config, DTYPES[sizes.dtype], e15_kernel_tokens
    k, num_experts = cfg.moe.top_k, cfg.moe.num_experts
    g = torch.Generator(device).manual_seed(0)
    with torch.device(device):
        layer = SparseMoE(cfg.E, cfg.moe).to(dtype).requires_grad_(False)
        for p in layer.parameters():
            nn.init.normal_(p, std=p.shape[-1] ** -0.5, generator=g)  # each output of unit scale
        xs = [torch.randn(T, cfg.E, generator=g, dtype=dtype) for _ in range(COPIES if device.type == "cuda" else 1)]
    pairs = runs_pairs(T, k, cfg.E)
    passes = [expert_passes(layer, x, k, num_experts) for x in xs]
    out = passes[0][0]()  # [T, E] summed over each token's pairs, or [T * top_k, E] each pair's
    weights, ids = layer.route(xs[0])
    n = min(T, CHECKED_TOKENS)
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    ref = experts_reference(xs[0][:n], gate_up, down, weights[:n], ids[:n]).view(n, k, -1).sum(1)
    got = out[:n] if pairs else out[: n * k].view(n, k, -1).sum(1)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 2e-2, f"the expert kernels disagree with the PyTorch reference: relative error {err:.3g}"

    timed = graph_seconds if device.type == "cuda" else lambda fns: launched_seconds(fns[0])
    seconds = timed([kernels for kernels, _ in passes])
    with_grouping = seconds if pairs else timed([whole for _, whole in passes])
    touched = sum(layer.route(x)[1].unique().numel() for x in xs) / len(xs)
    # what must move: each touched expert's gate_up and down, the tokens in, the outputs out (each token's or each
    # pair's; the intermediate [T * top_k, I_e] written by one kernel and read by the other is the design's)
    nbytes = (touched * (gate_up[0].numel() + down[0].numel()) + xs[0].numel() + out.numel()) * dtype.itemsize
    gbps = nbytes / seconds / 1e9
    env = kernel_environment(device)
    benchmark.extra_info.update(
        experiment="e15_kernel",
        model=sizes.e15_moe_model,
        B=T,
        path="pairs" if pairs else "grouped",
        E=cfg.E,
        I_e=cfg.moe.intermediate,
        num_experts=num_experts,
        top_k=k,
        experts_touched=touched,
        dtype=sizes.dtype,
        time_s=seconds,
        with_grouping_s=with_grouping,
        bytes=nbytes,
        gbps=gbps,
        pct_of_copy=100 * gbps / env["copy_gbps"] if env["copy_gbps"] else None,
        timer=f"CUDA graph over {COPIES} routings, median" if device.type == "cuda" else "host clock, one call",
        rel_err_vs_reference=err,
        **env,
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)

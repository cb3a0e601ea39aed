"""A run's memory-traffic floor: the bytes an engine must move to serve its workload, over the copy
bandwidth measured in the same run. The workload's alone (every configuration and peer has the same), so
a run's makespan over it says how far that run is from what the memory allows.

What it assumes: one token per request per forward pass (no speculative decoding), no K/V shared between
requests (no prefix read once for several), and the copy's pace (bytes read plus written) as the memory's
(a stream that only reads may go a little faster)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from weft.attention.base import AttentionBackend
from weft.benchmark.environment import copy_bandwidth_gbps
from weft.benchmark.workloads import Workload
from weft.config import ModelConfig


def weight_bytes(model: PreTrainedModel, batch: int | None = None) -> int:
    """The weight bytes one forward pass reads: all of them, but for an input embedding of its own (not the
    output layer's) only the rows of the pass's tokens, too few to count. Of a mixture of experts, a pass of
    `batch` tokens reads only the experts they are routed to: at batch 1 its top_k per layer, at batch B the
    N (1 - (1 - top_k / N) ** B) distinct ones B tokens routed uniformly touch on average (routing that favours
    some experts touches fewer); None: every expert."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embedding is not model.get_output_embeddings().weight:
        total -= embedding.numel() * embedding.element_size()
    config = model.config
    if batch is not None and getattr(config, "num_experts", 0):
        N, k = config.num_experts, config.num_experts_per_tok
        experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
        total -= round(experts * (1 - k / N) ** batch)  # the share of the experts no token touches
    return total


def kv_bytes_per_token(model: PreTrainedModel) -> int:
    """One token's K and V across all layers, in the model's dtype (what a KV pool spends on it)."""
    return AttentionBackend.block_bytes(ModelConfig.from_hf(model.config), 1, model.dtype)


def traffic_bytes(workload: Workload, model: PreTrainedModel) -> int:
    """Bytes that must move to serve `workload` with `model` (its outputs exactly as long as asked).

    A forward pass reads the weights once (of a mixture of experts at least each layer's top_k), and a request
    of n outputs needs n passes (one token each), so the run takes at least the longest request's n passes.
    Attention reads or writes each token's K/V once per pass of its request from its own on: the prompt's pass
    p tokens, the passes of outputs 2 .. n p + 1 .. p + n - 1 (a step's context, its new token in it):
    n * p + n * (n - 1) / 2 tokens' K/V in all.
    """
    passes = max(r.max_tokens for r in workload.requests)
    tokens = sum(r.max_tokens * len(r.prompt_token_ids) + r.max_tokens * (r.max_tokens - 1) // 2
                 for r in workload.requests)
    return passes * weight_bytes(model, 1) + tokens * kv_bytes_per_token(model)


def floor_s(nbytes: int, device: torch.device) -> float | None:
    """Seconds `nbytes` take at the device's measured copy bandwidth (bytes read plus written); None off
    CUDA. Measured on the first call and kept; that call copies 2 GiB, so it comes before a server takes the
    device's memory."""
    if device.type != "cuda":
        return None
    return nbytes / (copy_bandwidth_gbps() * 1e9)


def step_weights(hf: PreTrainedModel, batch: int, device: torch.device) -> dict[str, object]:
    """A decode step of `batch` requests: the weight bytes it reads and their time at the copy bandwidth (None off
    CUDA), and the model's experts (0: dense)."""
    nbytes = weight_bytes(hf, batch)
    return dict(weights_bytes=nbytes, weights_floor_s=floor_s(nbytes, device),
                num_experts=getattr(hf.config, "num_experts", 0))

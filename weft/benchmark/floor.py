"""A run's memory-traffic floor: the bytes any engine must move to serve its workload, over the copy
bandwidth measured in the same run. The workload's alone (every configuration and peer has the same), so
a run's makespan over it says how far that run is from what the memory allows."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from weft.benchmark.environment import copy_bandwidth_gbps
from weft.benchmark.workloads import Workload
from weft.config import ModelConfig


def traffic_bytes(workload: Workload, model: PreTrainedModel) -> int:
    """Bytes that must move to serve `workload` with `model` (its outputs exactly as long as asked).

    A forward pass reads every weight once, and a request of n outputs needs n passes (one token each),
    so the run takes at least the longest request's n passes. Attention reads each cached token's K/V once
    per later token of its request: a prompt of p tokens reads its own p once, then its outputs 2 .. n
    read p + 1 .. p + n - 1: n * p + n * (n - 1) / 2 tokens' K/V in all.
    """
    cfg = ModelConfig.from_hf(model.config)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * cfg.L * cfg.H_kv * cfg.D * torch.empty((), dtype=model.dtype).element_size()
    passes = max(r.max_tokens for r in workload.requests)
    reads = sum(r.max_tokens * len(r.prompt_token_ids) + r.max_tokens * (r.max_tokens - 1) // 2
                for r in workload.requests)
    return passes * weights + reads * kv_per_token


def floor_s(nbytes: int, device: torch.device) -> float | None:
    """Seconds `nbytes` take at the device's measured copy bandwidth (bytes read plus written); None off
    CUDA. Measured on first use and kept: call it before a server takes the memory the copy needs."""
    if device.type != "cuda":
        return None
    return nbytes / (copy_bandwidth_gbps() * 1e9)

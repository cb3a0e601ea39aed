"""The KV pool's size, decided once when the engine is built.

N blocks of P tokens (the contiguous backend: N rows of P = max_model_len tokens). N is
`num_blocks` when given; else the blocks that fit a memory budget (`kv_cache_memory_bytes`,
or on CUDA `gpu_memory_utilization` of the card less what is in use, or on the CPU
CPU_KV_CACHE_BYTES), and never more than max_num_seqs requests of max_model_len tokens fill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weft.config import ModelConfig
from weft.inference.config import CPU_KV_CACHE_BYTES, EngineConfig
from weft.utils import cdiv


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int  # N
    block_size: int  # P
    block_bytes: int  # K and V of one block across all L layers

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self, config: EngineConfig) -> str:
        """The start-up line: what the pool holds and what it costs."""
        per_request = cdiv(config.max_model_len, self.block_size)
        return (
            f"KV pool: {self.num_blocks:,} blocks of {self.block_size} tokens ({self.num_tokens:,} tokens, "
            f"{self.nbytes / 2**30:.2f} GiB, {config.attention}, {config.dtype}, {config.device}); "
            f"{self.num_blocks / per_request:.1f} requests of max_model_len={config.max_model_len} fit at once"
        )


def plan_pool(config: EngineConfig, model: ModelConfig) -> PoolPlan:
    """`config` has been through `for_model`; on CUDA call this once the weights are on the device."""
    backend = config.backend
    P = config.max_model_len if backend.row_per_request else config.block_size
    block_bytes = backend.block_bytes(model, P, config.torch_dtype)
    if config.num_blocks is not None:
        return PoolPlan(config.num_blocks, P, block_bytes)
    budget = config.kv_cache_memory_bytes
    if budget is None and config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        # memory PyTorch has cached but not handed out (a closed engine's, say) is free to us too
        free += torch.cuda.memory_reserved(config.device) - torch.cuda.memory_allocated(config.device)
        budget = int(free - (1 - config.gpu_memory_utilization) * total)
    elif budget is None:
        budget = CPU_KV_CACHE_BYTES
    num_blocks = min(budget // block_bytes, config.max_num_seqs * cdiv(config.max_model_len, P))
    if num_blocks < 1:
        raise ValueError(
            f"no memory for a KV pool: one {config.attention} block of {P} tokens takes {block_bytes:,} bytes "
            f"and the budget is {max(budget, 0):,} bytes (set num_blocks, kv_cache_memory_bytes or max_model_len)"
        )
    return PoolPlan(num_blocks, P, block_bytes)

"""BlockManager: hands out the pool's N blocks of P tokens to sequences.

The contiguous backend is the case P = S_max: a sequence then holds one block, its row.
"""

from __future__ import annotations

from collections import deque

from weft.inference.sequence import Sequence
from weft.utils import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks  # N
        self.block_size = block_size  # P
        self.free_blocks: deque[int] = deque(range(num_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` cache slots."""
        return cdiv(num_tokens, self.block_size)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can grow to cover `num_tokens` cache slots with the blocks free now."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks until it covers `num_tokens` slots; call `can_hold` first."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self.free_blocks.popleft())

    def release(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

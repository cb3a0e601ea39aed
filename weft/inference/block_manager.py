"""BlockManager: hands out the pool's N blocks of P tokens to sequences, and with prefix caching
shares the full blocks of prompts that begin alike.

The contiguous backend is the case P = S_max: a sequence then holds one block, its row (no caching).

A full block is known by a hash of its P tokens chained with its parent block's hash, so equal
hashes mean equal prefixes (the tokens are compared too, against a hash collision). A block once
computed is registered under its hash; a request whose prompt begins with registered blocks takes
them (a reference each) instead of computing them, but never the block holding its last prompt
token, which it must compute for its logits. A freed block keeps its hash and stays findable
until it is handed out again, least recently freed first. What holds of each block:

| a block is                         | references | in `free`        | in `cached`                      |
| ---------------------------------- | ---------- | ---------------- | -------------------------------- |
| held by k requests                 | k >= 1     | no               | if full, computed, first of its content |
| free and empty                     | 0          | yes              | no                               |
| free, holding a cached prefix      | 0          | yes (LRU order)  | yes, until handed out (evicted)  |

Where prompt tokens and generated ones are computed by kernels of their own (AttentionBackend.attends_by_role, the
deterministic mode), a block's hash also holds how many of its tokens its request generated: a prompt that repeats
an earlier request's generated tokens computes them in the prompt's kernels rather than reading them (the same
request's recompute after a preemption still takes its own).

A block is written only by the request that allocated it, at positions it has not computed yet;
shared blocks are full and computed, so no request ever writes a block another one reads.

With a sliding window of W keys in every layer, a query at position p sees keys p - W + 1 .. p only, so once a
sequence has computed n tokens, its leading blocks that end before n - W + 1 are never read again (its next
query is at n or later): they go back to the pool at once, and their table entries become 0, a placeholder that
the kernels never dereference and the padded backends mask. A step in flight may still read them, but any
request that takes one writes it in a later step, and the device runs steps in order.
"""

from __future__ import annotations

from collections import OrderedDict

from weft.inference.sequence import Sequence
from weft.utils import cdiv


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 window: int | None = None, roles: bool = False) -> None:
        self.num_blocks = num_blocks  # N
        self.block_size = block_size  # P
        self.prefix_caching = prefix_caching
        self.window = window  # W of a model whose every layer attends within a sliding window, else None
        self.roles = roles  # hashes tell generated tokens from prompt tokens
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # the next handed out first
        self.refs = [0] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` cache slots."""
        return cdiv(num_tokens, self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks no request holds (those keeping a cached prefix included)."""
        return len(self.free)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks `seq`'s tokens begin with (none without caching, or once it has computed
        any). Looks only: nothing is taken."""
        if not self.prefix_caching or seq.num_computed_tokens or seq.params.prompt_logprobs is not None:
            return []
        P, hits, parent = self.block_size, [], None
        for i in range((seq.num_tokens - 1) // P):  # the block of its last token is computed, not taken
            tokens = tuple(seq.token_ids[i * P : (i + 1) * P])
            h = self._hash(seq, i, parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            parent = h
        return hits

    def can_hold(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> bool:
        """Whether `seq` can grow to cover `num_tokens` cache slots (taking `prefix`, the cached blocks it
        begins with, first) with the blocks free now."""
        prefix = prefix or []
        new = self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix)
        return new <= self.num_free - sum(1 for b in prefix if self.refs[b] == 0)

    def take_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Give `seq` (which holds no blocks) the cached blocks it begins with: their tokens count as computed."""
        for block in prefix:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        seq.block_table = list(prefix)
        seq.block_hashes = [self.block_hash[b] for b in prefix]
        seq.num_computed_tokens = len(prefix) * self.block_size

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks until it covers `num_tokens` slots; call `can_hold` first."""
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:  # evicted: its prefix is no longer findable
                del self.cached[h]
                self.block_hash[block] = self.block_tokens[block] = None
            self.refs[block] = 1
            seq.block_table.append(block)

    def commit(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that its computed tokens have filled since the last call (those whose
        tokens are all known: a token still in flight holds its block back); with a window, give back the leading
        blocks it has left behind (registered first: they stay findable until handed out again)."""
        if self.prefix_caching:
            self._register(seq)
        if self.window is not None:
            behind = (seq.num_computed_tokens - self.window + 1) // self.block_size
            if self.prefix_caching:
                behind = min(behind, len(seq.block_hashes))
            for i in range(seq.num_dropped_blocks, behind):
                self._drop(seq.block_table[i])
                seq.block_table[i] = 0
            seq.num_dropped_blocks = max(seq.num_dropped_blocks, behind)

    def _register(self, seq: Sequence) -> None:
        P = self.block_size
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens, len(seq.token_ids)) // P):
            tokens = tuple(seq.token_ids[i * P : (i + 1) * P])
            h = self._hash(seq, i, seq.block_hashes[-1] if i else None, tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block], self.block_tokens[block] = h, tokens

    def _hash(self, seq: Sequence, i: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Block i of `seq` (its `tokens`), chained to its parent block's hash; with roles, and tokens `seq` generated
        in it, their count too."""
        generated = min(self.block_size, (i + 1) * self.block_size - seq.num_prompt_tokens) if self.roles else 0
        return hash((parent, tokens, generated)) if generated > 0 else hash((parent, tokens))

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; a block no request holds becomes free. Its last blocks are freed first,
        so that a prefix's leading blocks, the likeliest to be shared again, are evicted last: those left behind a
        window, freed earlier, move behind the rest (the first last), if still free and findable."""
        for block in reversed(seq.block_table[seq.num_dropped_blocks :]):
            self._drop(block)
        for h in reversed(seq.block_hashes[: seq.num_dropped_blocks]):
            block = self.cached.get(h)
            if block is not None and self.refs[block] == 0:
                self.free.move_to_end(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_dropped_blocks = 0

    def _drop(self, block: int) -> None:
        """One reference less; a block no request holds becomes free (keeping its hash)."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

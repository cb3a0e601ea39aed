"""Schedulers decide, each step, which sequences run and how many new tokens each brings.

- static: a batch is admitted only when the previous one has fully finished; its blocks
  are reserved up front for the longest it can grow, so it never preempts.
- continuous: iteration-level FCFS; running sequences decode first, then waiting ones are
  admitted under the token budget; when the pool runs out the latest-admitted sequence is
  preempted and later recomputed from its tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from weft.inference.block_manager import BlockManager
from weft.inference.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes its tokens [num_computed_tokens, +num_new_tokens[i])."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cache tokens it lost)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler(ABC):
    name: str

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted `seq`, waiting or running; its blocks return to the pool at once."""
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        seq.status = Status.FINISHED
        self.blocks.release(seq)

    @abstractmethod
    def schedule(self) -> ScheduledBatch: ...

    def _admit(self, seq: Sequence, reserve: int, batch: ScheduledBatch) -> None:
        """Move the head of the queue to running, with blocks for `reserve` cache slots."""
        self.waiting.popleft()
        self.blocks.grow(seq, reserve)
        seq.status = Status.RUNNING
        self.running.append(seq)
        batch.add(seq, seq.num_tokens - seq.num_computed_tokens)


class StaticScheduler(Scheduler):
    name = "static"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.running:
            for seq in self.running:
                batch.add(seq, 1)
            return batch
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > budget or not self.blocks.can_hold(seq, seq.max_kv_tokens):
                break
            budget -= seq.num_tokens
            self._admit(seq, seq.max_kv_tokens, batch)
        return batch


class ContinuousScheduler(Scheduler):
    name = "continuous"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            need = seq.num_tokens  # the newest token's K/V is written this step
            while not self.blocks.can_hold(seq, need):
                victim = self.running.pop()  # latest admitted goes first
                batch.preempted.append((victim, victim.num_computed_tokens))
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, need)
                batch.add(seq, need - seq.num_computed_tokens)
                budget -= need - seq.num_computed_tokens
                i += 1
        if batch.preempted:  # the pool is full: admitting now would only preempt again
            return batch
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # a preempted sequence may have outgrown the budget; it still runs, alone
            over_budget = seq.num_tokens > budget and len(batch) > 0
            if over_budget or not self.blocks.can_hold(seq, seq.num_tokens):
                break
            budget -= seq.num_tokens
            self._admit(seq, seq.num_tokens, batch)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)


SCHEDULERS: dict[str, type[Scheduler]] = {s.name: s for s in (StaticScheduler, ContinuousScheduler)}


def get_scheduler(name: str) -> type[Scheduler]:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}: choose from {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]

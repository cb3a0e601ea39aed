"""LLMEngine: the loop. Each step the scheduler decides, the runner computes, the engine records.

Requests wait in `pending` until their arrival tick (one tick per step); when nothing is
running and nobody has arrived yet, the clock jumps to the next arrival.
"""

from __future__ import annotations

import time

from weft.inference.outputs import EngineStats
from weft.inference.runner import ModelRunner
from weft.inference.scheduler import Scheduler
from weft.inference.sequence import Sequence


class LLMEngine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, eos_ids: frozenset[int], max_model_len: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.stats = EngineStats()
        self.tick = 0
        self.pending: list[Sequence] = []  # not yet arrived, latest arrival first

    def add_request(self, seq: Sequence) -> None:
        self.pending.append(seq)
        self.pending.sort(key=lambda s: (s.metrics.arrival_tick, s.seq_id), reverse=True)

    def has_unfinished(self) -> bool:
        return bool(self.pending) or self.scheduler.has_work()

    def step(self) -> list[Sequence]:
        """Run one tick; returns the sequences that finished in it."""
        if not self.scheduler.has_work():
            self.tick = max(self.tick, self.pending[-1].metrics.arrival_tick)
        self._admit_arrivals()
        batch = self.scheduler.schedule()
        self.stats.num_preemptions += len(batch.preempted)
        self.stats.recomputed_tokens += sum(lost for _, lost in batch.preempted)
        self.tick += 1
        if not batch:
            if not batch.preempted:
                raise RuntimeError("scheduler made no progress: this is a weft bug, please report it")
            return []
        self.stats.steps += 1
        start = time.perf_counter()
        sampled, tokens = self.runner.run(batch)
        now = time.perf_counter()  # the runner's tokens came back to the host: the device is done
        for seq, T in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
            if seq.num_computed_tokens == 0:
                self.stats.prefill_tokens += T
            else:
                self.stats.decode_tokens += T
            seq.num_computed_tokens += T
        finished = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.token_ids.append(token)
            seq.metrics.token_times.append(now)
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.finish_reason is not None:
                seq.metrics.finished_time = now
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def _admit_arrivals(self) -> None:
        now = time.perf_counter()
        while self.pending and self.pending[-1].metrics.arrival_tick <= self.tick:
            seq = self.pending.pop()
            seq.metrics.arrival_time = now
            self.scheduler.add(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_tokens >= seq.max_len:
            return "length"
        return None

"""Schedulers decide, each step, which sequences run and how many new tokens each brings.

- static: a batch is admitted only when the previous one has fully finished; its blocks
  are reserved up front for the longest it can grow, so it never preempts.
- continuous: iteration-level FCFS; running sequences first, then waiting ones are admitted
  under the token budget; when the pool runs out the last one running is preempted (the latest
  admitted; a request's completions run side by side) and later recomputed from its tokens.

Both cut prefills into chunks under the step's token budget when chunked prefill is on. A request's n
completions are n sequences; under the continuous scheduler with prefix caching the later ones are held back
until the first has computed the prompt, then go to the head of the queue and take its blocks from the cache
(the static one admits them together, each computing it).
A scheduler owns its sequences' state for their whole life (with its block manager, their blocks): `schedule`
picks a step's work, `launched` marks it queued on the device, `landed` takes its tokens back, and
`remove` ends a request; nothing else writes a sequence's status, counts or tokens.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from weft.inference.block_manager import BlockManager
from weft.inference.detokenizer import first_stop
from weft.inference.outputs import Logprob
from weft.inference.sampling import follows_rules
from weft.inference.sequence import Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes its tokens [num_computed_tokens, +num_new_tokens[i])."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, cache tokens it lost)
    admitted_tokens: int = 0  # the known tokens of the requests admitted this step
    cached_tokens: int = 0  # of those, the ones found in the prefix cache (not computed)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def decodes_first(self) -> ScheduledBatch:
        """The one-token requests first (a backend sends them to its decode kernel), the rest in order."""
        if all(T == 1 for T in self.num_new_tokens):
            return self
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_new_tokens[i] != 1)
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]
        return self

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepOutput:
    """What a launched step gives back once its sampled ids are on the host."""

    landed_at: float  # time.perf_counter once the ids were on the host: the device was done with the step
    sampled: list[Sequence]  # the sequences that got a next token, in the order of their rows
    tokens: list[int]  # those tokens
    logprobs: list[dict[int, Logprob] | None]  # per sampled sequence: its token's, if it asks for logprobs
    prompt_logprobs: list[tuple[Sequence, dict[int, Logprob]]]  # (request, its next prompt token's), in order


class Scheduler(ABC):
    """`max_num_batched_tokens` is the step's token budget. With `chunked_prefill` every request's share
    is cut to what the budget has left (a long prompt is prefilled over several steps, beside the
    running decodes); without it a request always computes all it lacks, and the budget bounds only
    admission. A token in `eos_token_ids` stops a request that does not ignore EOS."""

    name: str
    holds_siblings: bool  # whether a request's later completions wait for its first to compute the prompt

    def __init__(
        self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, chunked_prefill: bool,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.blocks = blocks  # the engine's
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[Sequence, list[Sequence]] = {}  # a request's first completion -> its others, held back

    def add(self, seq: Sequence) -> None:
        if seq.first is not None and self.holds_siblings and self.blocks.prefix_caching:
            self.held.setdefault(seq.first, []).append(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    @property
    def num_waiting(self) -> int:
        """Requests' completions not running: queued, or held back for their first's prompt."""
        return len(self.waiting) + sum(map(len, self.held.values()))

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted `seq`, waiting, held back or running; its blocks return to the pool at once. A
        first completion dropped before its prompt was computed lets its others go, to compute it themselves."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.held.get(seq.first, ()):
            self.held[seq.first].remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.blocks.release(seq)
        self._release(seq)

    def _release(self, first: Sequence) -> None:
        """`first`'s held completions to the head of the queue: admitted next, they take its prompt's blocks."""
        self.waiting.extendleft(reversed(self.held.pop(first, [])))

    @abstractmethod
    def schedule(self) -> ScheduledBatch: ...

    def launched(self, batch: ScheduledBatch, sampled: list[Sequence], now: float) -> None:
        """`batch` is queued on the device (at `now`): its new tokens count as computed, and the blocks they fill
        with known tokens are registered for the prefix cache (a later step reads them after this one has written
        them: the device runs steps in order); each of `sampled`, its rows in order, awaits its next token. A
        request that stopped while the step was being queued (the steps before landed meanwhile) is left as it
        is: the token it awaits is dropped when it lands."""
        for seq, T in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is Status.FINISHED:
                continue
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            seq.num_computed_tokens += T
            self.blocks.commit(seq)
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._release(seq)
        for row, seq in enumerate(sampled):
            seq.num_pending += 1
            seq.pending_row = row

    def landed(self, step: StepOutput) -> list[Sequence]:
        """A launched step's ids are on the host: each sampled request still running takes its token
        and its logprobs; one that stops is removed, its blocks freed, and the others register the block their
        token filled -> the requests that took a token, in order (aborted ones, and ones that stopped while this
        step was in flight, take none), and those whose rules left them nothing to sample, which end as aborted."""
        for seq, entry in step.prompt_logprobs:
            seq.prompt_logprobs.append(entry)
        for seq in step.sampled:
            seq.num_pending -= 1
        landing = [row for row in zip(step.sampled, step.tokens, step.logprobs, strict=True)
                   if row[0].status is not Status.FINISHED]
        took = []
        for seq, token, entry in landing:
            if not follows_rules(seq, token):
                # its rules together left nothing to sample (allowed_token_ids the grammar does not reach): the
                # request ends without the token, as aborted, and the others run on
                logger.warning("request %s: nothing its rules allow is left to sample; aborted", seq.request_id)
                seq.finish_reason = "abort"
                seq.metrics.finished_time = step.landed_at
                self.remove(seq)
                if seq.detokenizer is not None:
                    seq.detokenizer.add([], final=True)
                took.append(seq)
                continue
            seq.token_ids.append(token)
            if entry is not None:
                seq.logprobs.append(entry)
            seq.metrics.token_times.append(step.landed_at)
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                seq.metrics.finished_time = step.landed_at
                self.remove(seq)
            else:
                self.blocks.commit(seq)
            took.append(seq)
        return took

    def _check_stop(self, seq: Sequence, token: int) -> None:
        """Advance its text by `token` (its grammar has taken it), then end it if `token` stops it: a stop token, EOS,
        its grammar complete, a stop string in its text (cut there: the text ends before it, or with it if asked),
        its length."""
        p, detok = seq.params, seq.detokenizer
        added = detok.add([token], final=False) if detok is not None else ""
        stop = first_stop(detok.text, len(added), p.stop) if added and p.stop else None
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif seq.matcher is not None and seq.matcher.terminated:
            seq.finish_reason = "stop"
        elif stop is not None and seq.num_output_tokens > p.min_tokens:  # as a stop token waits: min_tokens before it
            at, string = stop
            detok.text = detok.text[: at + len(string) if p.include_stop_str_in_output else at]
            seq.finish_reason, seq.stop_reason = "stop", string
            return
        elif len(seq.token_ids) >= seq.max_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None and detok is not None:
            detok.add([], final=True)  # what an incomplete last character held back

    def _share(self, seq: Sequence, budget: int, computed: int | None = None) -> int:
        """New tokens for `seq` this step: all it lacks beyond `computed` (its own count by default), cut
        to the budget left with chunked prefill."""
        if seq.num_tokens >= seq.max_len:  # its last token is in flight: it finishes when that lands
            return 0
        lacking = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        return max(0, min(lacking, budget)) if self.chunked_prefill else lacking

    def _admit(self, seq: Sequence, prefix: list[int], reserve: int, batch: ScheduledBatch) -> None:
        """Move the head of the queue to running: the cached blocks it begins with, then blocks for
        `reserve` cache slots."""
        self.waiting.popleft()
        self.blocks.take_prefix(seq, prefix)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.blocks.grow(seq, reserve)
        seq.status = Status.RUNNING
        self._place(seq)
        batch.admitted_tokens += seq.num_tokens
        batch.cached_tokens += seq.num_computed_tokens

    def _place(self, seq: Sequence) -> None:
        """`seq` into the running order: last (the latest admitted), but a request's later completion right after
        its others that run, so that a step's decodes that share a prompt read its K/V one after another, where the
        GPU's L2 cache may serve the repeats."""
        first = seq.first
        if first is None or first.status is not Status.RUNNING:
            self.running.append(seq)
            return
        at = self.running.index(first) + 1
        while at < len(self.running) and self.running[at].first is first:
            at += 1
        self.running.insert(at, seq)


class StaticScheduler(Scheduler):
    """A batch is admitted only when the last one has finished, its blocks reserved for the longest
    each request can grow (it never preempts); without chunked prefill its prompts must fit the budget."""

    name = "static"
    holds_siblings = False

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if not self.running:
            prompts = 0
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                prefix = self.blocks.cached_prefix(seq)
                if not self.blocks.can_hold(seq, seq.max_kv_tokens, prefix):
                    break
                if not self.chunked_prefill and prompts + seq.num_tokens > budget:
                    break
                prompts += seq.num_tokens
                self._admit(seq, prefix, seq.max_kv_tokens, batch)
        for seq in self.running:
            T = self._share(seq, budget)
            if T:
                batch.add(seq, T)
                budget -= T
        return batch.decodes_first()


class ContinuousScheduler(Scheduler):
    """FCFS at every step: running requests first, then waiting ones while the budget, max_num_seqs and
    the pool allow; when the pool runs out the last running is preempted, to be recomputed."""

    name = "continuous"
    holds_siblings = True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget, P = self.max_num_batched_tokens, self.blocks.block_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            T = self._share(seq, budget)
            if T == 0:  # the budget is spent: it waits a step
                i += 1
                continue
            need = seq.num_computed_tokens + T  # the cache slots it covers once this step has written
            if need > len(seq.block_table) * P:  # it needs more blocks (most decodes have room in their last)
                if seq.num_pending and not self.blocks.can_hold(seq, need):
                    i += 1  # its token is in flight and may stop it: no preemption for it before that lands
                    continue
                while not self.blocks.can_hold(seq, need):
                    victim = self.running.pop()  # the latest admitted request goes first
                    batch.preempted.append((victim, victim.num_computed_tokens))
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    self.blocks.grow(seq, need)
                if seq.status is not Status.RUNNING:  # it was the one preempted
                    continue
            batch.add(seq, T)
            budget -= T
            i += 1
        if batch.preempted:  # the pool is full: admitting now would only preempt again
            return batch.decodes_first()
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.blocks.cached_prefix(seq)
            cached = len(prefix) * self.blocks.block_size
            T = self._share(seq, budget, cached)
            # without chunking a preempted sequence may have outgrown the budget; it still runs, alone
            over_budget = T == 0 or (T > budget and len(batch) > 0)
            if over_budget or not self.blocks.can_hold(seq, cached + T, prefix):
                break
            budget -= T
            self._admit(seq, prefix, cached + T, batch)
            batch.add(seq, T)
        return batch.decodes_first()

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

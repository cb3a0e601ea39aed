"""Each step's sampling settings and logit rules, as tensors, from the requests it samples for.

The rules that need a request's tokens are kept where those tokens are: the token counts of a request with a
penalty live on the device (a row of `counts` each, which the step's sampled ids update there), so they hold
the overlap's pending tokens without a copy to the host. Bans that follow the output as text does (bad words of
several tokens, a grammar's mask) are built on the host, which has every token of such a request: the engine
lands the steps before its step once that step's forward pass is queued, before its sampling
(Sequence.needs_host_tokens); a request that stopped there has no rules.
"""

from __future__ import annotations

import torch

from weft.inference.sequence import Sequence, Status
from weft.layers.sampler import MASK32, LogitRules, SamplingTensors


class SamplingState:
    """`capacity` rows of token counts (the most requests a step holds), allocated at the first request with a
    penalty; V is the logits' width; `eos_token_ids` are banned, with the stop tokens, under min_tokens."""

    def __init__(self, V: int, device: torch.device, capacity: int, eos_token_ids: frozenset[int]) -> None:
        self.V, self.device, self.capacity = V, device, capacity
        self.eos_token_ids = tuple(eos_token_ids)
        self.row_of: dict[Sequence, int] = {}  # requests with a penalty -> their row of counts
        self.counts: torch.Tensor | None = None  # [capacity, V] int32: each token's count in the output
        self.in_prompt: torch.Tensor | None = None  # [capacity, V] bool

    def settings(self, seqs: list[Sequence]) -> SamplingTensors | None:
        """The sampled rows' settings as tensors (None when every row is greedy)."""
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return None
        floats = [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]]
        seeds = [p.seed if p.seed is not None else 0 for p in params]
        ints = [
            [p.top_k if p.top_k > 0 else self.V for p in params],
            [p.seed is not None for p in params],
            [seed & MASK32 for seed in seeds],
            [(seed >> 32) & MASK32 for seed in seeds],
            [s.num_tokens for s in seqs],
        ]  # fmt: skip
        max_top_k = max(ints[0])
        filtered = max_top_k < self.V or any(p.top_p < 1 or p.min_p > 0 for p in params)
        floats, ints = device_tensor(floats, torch.float32, self.device), device_tensor(ints, torch.int64, self.device)
        return SamplingTensors(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], top_k=ints[0], seeded=ints[1].bool(),
            seed=ints[2:4].T, position=ints[4], max_top_k=max_top_k, filtered=filtered,
        )  # fmt: skip

    def rules(self, seqs: list[Sequence]) -> LogitRules | None:
        """The logit rules of the sampled rows `seqs` (None when no row has a rule). A grammar's mask is filled
        here, while the device runs the forward pass."""
        ruled = [(i, s) for i, s in enumerate(seqs) if not s.params.plain and s.status is not Status.FINISHED]
        if not ruled:
            return None
        allowed_rows, allowed_at, allowed_ids = [], [], []
        bias_rows, bias_tokens, bias = [], [], []
        penalized, grammar_rows = [], []
        for i, s in ruled:
            p = s.params
            if p.allowed_token_ids is not None:
                allowed_at += [len(allowed_rows)] * len(p.allowed_token_ids)
                allowed_ids += p.allowed_token_ids
                allowed_rows.append(i)
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                bias += p.logit_bias.values()
            banned = banned_tokens(s, self.eos_token_ids)
            bias_rows += [i] * len(banned)
            bias_tokens += banned
            bias += [float("-inf")] * len(banned)
            if p.penalized:
                penalized.append((i, s))
            if s.matcher is not None:
                grammar_rows.append((i, s))
        # one row of allowed tokens per request that has some: its allowed_token_ids, its grammar's, or the tokens
        # in both (a logits row may appear once in allowed_rows: adjust writes each row of it back once)
        listed = len(allowed_rows)
        allowed = torch.zeros(listed, self.V, dtype=torch.bool, device=self.device)
        # index_fill_ takes its value as a kernel argument: `allowed[rows, ids] = True` would copy a CPU scalar over
        # and wait for the device, every step
        flat = [r * self.V + t for r, t in zip(allowed_at, allowed_ids, strict=True)]
        allowed.view(-1).index_fill_(0, self._ints(flat), True)
        if grammar_rows:
            at = {row: n for n, row in enumerate(allowed_rows)}
            unlisted = [i for i, _ in grammar_rows if i not in at]
            allowed = torch.cat([allowed, torch.ones(len(unlisted), self.V, dtype=torch.bool, device=self.device)])
            at.update((row, listed + n) for n, row in enumerate(unlisted))
            allowed_rows += unlisted
            grammar = self._ints([at[i] for i, _ in grammar_rows])
            allowed[grammar] &= grammar_masks([s for _, s in grammar_rows], self.V, self.device)
        count_rows = self._rows([s for _, s in penalized])
        pen = [s.params for _, s in penalized]
        floats = device_tensor([[p.presence_penalty for p in pen], [p.frequency_penalty for p in pen],
                                [p.repetition_penalty for p in pen]], torch.float32, self.device)
        none = torch.zeros(0, self.V, dtype=torch.int32, device=self.device)
        return LogitRules(
            allowed_rows=self._ints(allowed_rows), allowed=allowed,
            bias_rows=self._ints(bias_rows), bias_tokens=self._ints(bias_tokens),
            bias=device_tensor(bias, torch.float32, self.device),
            penalty_rows=self._ints([i for i, _ in penalized]), count_rows=count_rows,
            counts=self.counts if pen else none, in_prompt=self.in_prompt if pen else none.bool(),
            presence=floats[0], frequency=floats[1], repetition=floats[2],
        )  # fmt: skip

    def count(self, rules: LogitRules, tokens: torch.Tensor) -> None:
        """The step's sampled ids `tokens` [B'] into the counts of the requests with a penalty (on the device)."""
        if rules.count_rows.numel():
            picked = tokens.index_select(0, rules.penalty_rows)
            ones = torch.ones_like(picked, dtype=torch.int32)
            self.counts.index_put_((rules.count_rows, picked), ones, accumulate=True)

    def _rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each request's row of counts [R] int64; a request without one gets one, filled from its tokens (all on
        the host: it has none in flight before its first step sampled, nor when it comes back from a preemption)."""
        for seq in seqs:
            if seq in self.row_of:
                continue
            if self.counts is None:
                self.counts = torch.zeros(self.capacity, self.V, dtype=torch.int32, device=self.device)
                self.in_prompt = torch.zeros(self.capacity, self.V, dtype=torch.bool, device=self.device)
            row = self._free_row()
            self.row_of[seq] = row
            prompt, output = self._ints(seq.prompt_token_ids), self._ints(seq.token_ids[seq.num_prompt_tokens :])
            self.in_prompt[row].zero_().index_fill_(0, prompt, True)
            # index_add_, not bincount: bincount's length waits on the device for the largest id
            self.counts[row].zero_().index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        return self._ints([self.row_of[seq] for seq in seqs])

    def _free_row(self) -> int:
        """A row no running request holds: a finished request's, else a waiting (preempted) one's, which it
        fills again from its tokens when it next samples."""
        used = set(self.row_of.values())
        free = next((r for r in range(self.capacity) if r not in used), None)
        if free is not None:
            return free
        for status in (Status.FINISHED, Status.WAITING):
            seq = next((s for s in self.row_of if s.status is status), None)
            if seq is not None:
                return self.row_of.pop(seq)
        raise RuntimeError("more requests with a penalty than rows of counts: this is a weft bug, please report it")

    def _ints(self, values) -> torch.Tensor:
        return device_tensor(values, torch.int64, self.device)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a list of lists) as a tensor on `device`, copied without the host waiting for the
    device: from pinned memory on CUDA (a blocking copy, or one from pageable memory, may wait for the step the
    device is running, which undoes the overlap)."""
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def banned_tokens(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The tokens `seq` may not sample next: its stop tokens while it has fewer than min_tokens (EOS too unless it
    ignores it), its one-token bad words, and the last token of each longer bad word whose other tokens its output
    ends with."""
    p = seq.params
    banned = []
    if seq.num_output_tokens < p.min_tokens:
        banned += p.stop_token_ids
        if not p.ignore_eos:
            banned += eos_token_ids
    output = seq.token_ids[seq.num_prompt_tokens :]
    for word in seq.bad_words_ids:
        if len(word) == 1 or (len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1 :]) ==
                              word[:-1]):
            banned.append(word[-1])
    return banned


def grammar_masks(seqs: list[Sequence], V: int, device: torch.device) -> torch.Tensor:
    """The tokens each request's grammar allows next [S, V] bool on `device`, from the matchers' bitmasks, filled
    on the host and unpacked on the device (bit j of word w: token 32 w + j)."""
    from weft.inference.structured import allowed_tokens, fill_bitmask, new_bitmask

    bitmask = new_bitmask(len(seqs), V)  # [S, ceil(V / 32)] int32
    fill_bitmask([seq.matcher for seq in seqs], bitmask)
    pinned = bitmask.pin_memory() if device.type == "cuda" else bitmask  # a pageable copy may wait on the device
    return allowed_tokens(pinned.to(device, non_blocking=True), V)

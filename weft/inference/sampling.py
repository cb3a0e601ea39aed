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
from weft.layers.bitmask import allows, token_bitmask
from weft.layers.sampler import MASK32, LogitRules, SamplingTensors
from weft.utils import cdiv

ALIGN = 16  # bytes: where each of a step's settings starts on the device


class SamplingState:
    """`capacity` rows of token counts (the most requests a step holds), allocated at the first request with a
    penalty; V is the logits' width; `eos_token_ids` are banned, with the stop tokens, under min_tokens."""

    def __init__(self, V: int, device: torch.device, capacity: int, eos_token_ids: frozenset[int]) -> None:
        self.V, self.device, self.capacity = V, device, capacity
        self.eos_token_ids = tuple(eos_token_ids)
        self.row_of: dict[Sequence, int] = {}  # requests with a penalty -> their row of counts
        self.counts: torch.Tensor | None = None  # [capacity, V] int32: each token's count in the output
        self.in_prompt: torch.Tensor | None = None  # [capacity, V] bool
        self._words = cdiv(V, 32)

    def settings(self, seqs: list[Sequence]) -> SamplingTensors | None:
        """The sampled rows' settings as tensors (None when every row is greedy)."""
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            return None
        temperature, top_p, min_p = device_rows(
            [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
            torch.float32, self.device)  # fmt: skip
        seeds = [p.seed if p.seed is not None else 0 for p in params]
        top_k = [p.top_k if p.top_k > 0 else self.V for p in params]
        top_k_row, seeded, seed, position = device_rows(
            [top_k, [p.seed is not None for p in params],
             [half for seed in seeds for half in (seed & MASK32, (seed >> 32) & MASK32)], [s.num_tokens for s in seqs]],
            torch.int64, self.device)  # fmt: skip
        max_top_k = max(top_k)
        return SamplingTensors(
            temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k_row, seeded=seeded.bool(),
            seed=seed.view(-1, 2), position=position, max_top_k=max_top_k,
            filtered=min(top_k) < self.V or any(p.top_p < 1 or p.min_p > 0 for p in params),
        )  # fmt: skip

    def rules(self, seqs: list[Sequence]) -> LogitRules | None:
        """The logit rules of the sampled rows `seqs` (None when no row has a rule), built while the device runs the
        forward pass (a grammar's mask is its matcher's row, refilled as the steps before landed)."""
        ruled = [(i, s) for i, s in enumerate(seqs) if not s.params.plain and s.status is not Status.FINISHED]
        if not ruled:
            return None
        allowed_rows, allowed = [], []
        bias_rows, bias_tokens, bias = [], [], []
        penalized = []
        for i, s in ruled:
            p = s.params
            if p.allowed_token_ids is not None or s.matcher is not None:
                allowed_rows.append(i)
                allowed.append(self._allowed(s))
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
        rows, tokens, penalty_rows, count_rows = device_rows(
            [allowed_rows + bias_rows, bias_tokens, [i for i, _ in penalized],
             self._rows([s for _, s in penalized])], torch.int64, self.device)  # fmt: skip
        pen = [s.params for _, s in penalized]
        bias, presence, frequency, repetition = device_rows(
            [bias, [p.presence_penalty for p in pen], [p.frequency_penalty for p in pen],
             [p.repetition_penalty for p in pen]], torch.float32, self.device)  # fmt: skip
        none = torch.zeros(0, self.V, dtype=torch.int32, device=self.device)
        return LogitRules(
            allowed_rows=rows[: len(allowed_rows)], allowed=self._bitmask(allowed),
            bias_rows=rows[len(allowed_rows) :], bias_tokens=tokens, bias=bias, penalty_rows=penalty_rows,
            count_rows=count_rows, counts=self.counts if pen else none,
            in_prompt=self.in_prompt if pen else none.bool(),
            presence=presence, frequency=frequency, repetition=repetition,
        )  # fmt: skip

    def count(self, rules: LogitRules, tokens: torch.Tensor) -> None:
        """The step's sampled ids `tokens` [B'] into the counts of the requests with a penalty (on the device; each
        request's row is its own, so no two rows add to one count)."""
        if rules.count_rows.numel():
            picked = tokens.index_select(0, rules.penalty_rows)
            self.counts.view(-1).index_add_(0, rules.count_rows * self.V + picked,
                                            torch.ones_like(picked, dtype=torch.int32))

    def _rows(self, seqs: list[Sequence]) -> list[int]:
        """Each request's row of counts; a request without one gets one, filled from its tokens (all on the host: it
        has none in flight before its first step sampled, nor when it comes back from a preemption)."""
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
        return [self.row_of[seq] for seq in seqs]

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

    @staticmethod
    def _allowed(seq: Sequence) -> torch.Tensor:
        """The tokens `seq` may sample next, int32 [1, ceil(V / 32)] on the host: its grammar's, its
        allowed_token_ids', or the tokens in both."""
        if seq.matcher is None:
            return seq.allowed
        return seq.matcher.next if seq.allowed is None else seq.matcher.next & seq.allowed

    def _bitmask(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Host bitmask rows [1, W] each -> int32 [len(rows), W] on the device, in one copy (from pinned memory on
        CUDA: a pageable copy may wait on the device; the allocator keeps the buffer until the copy has run)."""
        W = self._words
        if not rows:
            return torch.empty(0, W, dtype=torch.int32, device=self.device)
        host = torch.empty(len(rows), W, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        torch.cat(rows, out=host)
        return host.to(self.device, non_blocking=True)

    def _ints(self, values) -> torch.Tensor:
        return device_tensor(values, torch.int64, self.device)


def device_rows(rows: list[list], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Lists of numbers -> a 1-D tensor each on `device`, views of one copy made as `device_tensor` makes it, each
    starting 16-byte aligned: the Triton kernels are compiled for the alignment of their pointers, so a view at
    another one (a batch size that moved it) would compile them again, for a second or so, mid-serving."""
    per = ALIGN // torch.empty((), dtype=dtype).element_size()
    sizes = [len(row) for row in rows]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // per) * per)
    if not starts[-1]:  # nothing to copy (a step without biases or penalties)
        return [torch.empty(0, dtype=dtype, device=device) for _ in rows]
    flat = [0] * starts[-1]
    for row, start in zip(rows, starts, strict=False):
        flat[start : start + len(row)] = row
    buffer = device_tensor(flat, dtype, device)
    return [buffer[start : start + n] for start, n in zip(starts, sizes, strict=False)]


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
    output = seq.token_ids[seq.num_prompt_tokens :] if seq.bad_words_ids else []
    for word in seq.bad_words_ids:
        if len(word) == 1 or (len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1 :]) ==
                              word[:-1]):
            banned.append(word[-1])
    return banned


def can_sample(seq: Sequence, eos_token_ids: tuple[int, ...], V: int) -> bool:
    """Whether `seq`'s rules leave it any token to sample next: its grammar's and allowed_token_ids' tokens, less the
    ones banned now."""
    banned = banned_tokens(seq, eos_token_ids)
    if seq.matcher is None and seq.allowed is None:
        return len(set(banned)) < V
    return bool((SamplingState._allowed(seq) & ~token_bitmask(banned, V)).any())


def follows_rules(seq: Sequence, token: int) -> bool:
    """Whether `token` is one `seq`'s allowed_token_ids and grammar allow (advancing its grammar by it if so); one
    they do not was drawn from a row of -inf: its rules had left nothing to sample."""
    if seq.allowed is not None and not allows(seq.allowed, token):
        return False
    return seq.matcher is None or seq.matcher.accept(token)

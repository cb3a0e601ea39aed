"""ModelRunner: one forward pass for a scheduled batch.

It flattens the batch into T_total tokens and builds the attention metadata once per
step (host lists -> one transfer), runs the model (from CUDA graphs where it has them: a
decode step whole, a step of decodes and a few prompts whole, another piecewise), and samples
one token for every sequence whose known tokens are all in the cache after this step, in two
calls that return as soon as their work is queued on the device: `launch_forward`, then
`launch_sampling` (the sampled ids on their way to the host), so that the engine can land the
steps before in between while the forward runs. A sequence whose newest token has not landed
yet (the engine's overlap) reads it on the device, from the last step's ids.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from weft.attention.base import AttentionBackend, AttentionMetadata
from weft.distributed import SINGLE, TensorParallel
from weft.inference.cuda_graphs import DecodeGraphs, MixedGraphs, PiecewiseGraphs
from weft.inference.logprobs import Entries, as_dict, logprob_entries
from weft.inference.sampling import SamplingState, device_tensor
from weft.inference.scheduler import ScheduledBatch, StepOutput
from weft.inference.sequence import Sequence
from weft.layers.sampler import sample
from weft.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class StepLayout:
    """Where a step's ints lie in its one transfer; the other tensor-parallel ranks are sent this (`header`) first."""

    B: int
    T_total: int
    width: int  # block table columns
    num_sampled: int  # B': the requests that get a next token
    num_prompt_rows: int  # rows whose next token is a prompt token a prompt_logprobs request scores
    num_pending: int  # rows whose token is the last step's, still on the device
    max_query_len: int
    max_context_len: int
    num_decodes: int
    num_groups: int  # G: groups of decodes sharing their leading blocks (AttentionBackend.prefix_groups)
    roles: int  # 1: each request's prompt tokens among its new ones are sent (AttentionBackend.attends_by_role)
    num_prompt_tokens: int  # their sum

    @property
    def sizes(self) -> list[int]:
        """input ids, positions, query starts, context lengths, logit rows, block tables, pending rows and
        their rows in the last step's ids, the groups and each request's shared tokens (none without groups), each
        request's prompt tokens (none without roles); then the slots (after the padded parts)."""
        pending, G = self.num_pending, self.num_groups
        return [self.T_total, self.T_total, self.B + 1, self.B, self.num_sampled + self.num_prompt_rows,
                self.B * self.width, pending, pending, 3 * G, self.B if G else 0, self.B * self.roles, self.T_total]

    @property
    def offsets(self) -> list[int]:
        """Where each part starts: every part padded to an even length, so that each view starts 16-byte
        aligned, as the Triton kernels are compiled for (else they compile again mid-serving)."""
        return np.cumsum([0] + [n + n % 2 for n in self.sizes[:-1]]).tolist()

    @property
    def numel(self) -> int:
        return self.offsets[-1] + self.T_total

    @property
    def header(self) -> list[int]:
        return [getattr(self, f.name) for f in fields(self)]

    def views(self, flat: torch.Tensor) -> StepTensors:
        """The step's tensors, views of `flat` [numel] int64 on the device."""
        ids, pos, starts, lens, rows, tables, pending_at, pending_from, groups, shared, prompt, slots = (
            flat[i : i + n] for i, n in zip(self.offsets, self.sizes, strict=True))
        G = self.num_groups
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts.to(torch.int32),
            context_lens=lens.to(torch.int32),
            block_tables=tables.view(self.B, self.width).to(torch.int32),
            max_query_len=self.max_query_len,
            max_context_len=self.max_context_len,
            num_decodes=self.num_decodes,
            decode_groups=groups.view(G, 3).to(torch.int32) if G else None,
            shared_lens=shared.to(torch.int32) if G else None,
            prompt_tokens=prompt.to(torch.int32) if self.roles else None,
            num_prompt_tokens=self.num_prompt_tokens,
        )
        return StepTensors(ids, pos, meta, rows, pending_at, pending_from)


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T_total] int64
    positions: torch.Tensor  # [T_total] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [B' + prompt rows] int64: each sampled request's last new token, then prompt rows
    pending_at: torch.Tensor  # [pending] int64: rows whose token the last step sampled
    pending_from: torch.Tensor  # [pending] int64: its row among that step's sampled ids


@dataclass
class StepLists:
    """A step's inputs as host lists, gathered request by request (no loop over tokens), before they are packed
    into the one transfer; `parts` in `StepLayout.sizes`' order but the slots, which packing derives."""

    layout: StepLayout
    parts: tuple[Iterable[int], ...]  # input ids, positions, query starts, context lengths, logit rows, block
    # tables (B rows of `width` blocks; an iterator, which packing reads once), pending rows, their rows in the
    # last step's ids, the groups, the shared tokens, the prompt tokens
    num_new_tokens: list[int]  # T of each request
    sampling: list[Sequence]  # the B' sequences that get a next token
    prompt_targets: list[int]  # the next token of each prompt row
    prompt_owners: list[Sequence]  # the request of each prompt row


@dataclass
class StepInputs:
    tensors: StepTensors  # on the device
    lists: StepLists  # what they were packed from


@dataclass
class Forwarded:
    """A step whose forward pass is queued on the device, its sampling not yet."""

    lists: StepLists
    logits: torch.Tensor  # [B' + prompt rows, V]: the step's logit rows

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a sampled request's logit rules need its tokens on the host (Sequence.needs_host_tokens): the
        steps before must land before this one's sampling is queued."""
        return any(s.needs_host_tokens for s in self.lists.sampling)


@dataclass
class Launched:
    """A step queued on the device; `land` waits for its sampled ids."""

    sampled: list[Sequence]
    tokens: torch.Tensor  # [B'] int64 on the device: the next step's pending inputs are read here
    host: torch.Tensor  # [B'] int64 (pinned on CUDA): the copy of `tokens` in flight
    copied: torch.cuda.Event | None  # recorded after that copy (None off CUDA: it is done)
    logprobs: list[Entries | None]
    prompt_logprobs: list[tuple[Sequence, Entries]]

    @property
    def lands_at_once(self) -> bool:
        """Whether the engine lands it before planning the next step: it carries logprobs."""
        return bool(self.prompt_logprobs) or any(e is not None for e in self.logprobs)

    def land(self, decode: Callable[[list[int]], str] | None) -> StepOutput:
        """Wait for the sampled ids -> the step's output, its logprobs as vLLM's entries (`decode`: token ids to
        text, for their decoded tokens; None: no text)."""
        if self.copied is not None:
            self.copied.synchronize()
        return StepOutput(time.perf_counter(), self.sampled, self.host.tolist(),
                          [as_dict(e, decode) if e is not None else None for e in self.logprobs],
                          [(seq, as_dict(e, decode)) for seq, e in self.prompt_logprobs])


def gather(batch: ScheduledBatch, attn: AttentionBackend) -> StepLists:
    """`batch`'s inputs as host lists, from per-request slices; a request whose newest token is still on the
    device (pending) gets a placeholder row, filled on the device when the lists are packed; the decodes' groups
    as `attn` finds them, and each request's prompt tokens among its new ones where `attn` attends by role."""
    input_ids: list[int] = []
    positions: list[int] = []
    starts, context_lens, sample_rows, sampling = [0], [], [], []
    prompt_rows, prompt_targets, prompt_owners = [], [], []
    pending_at, pending_rows = [], []  # rows of this step whose token is pending, and its row among those ids
    roles, prompt_tokens = attn.attends_by_role, []
    for seq, T in zip(batch.seqs, batch.num_new_tokens, strict=True):
        begin, end = seq.num_computed_tokens, seq.num_computed_tokens + T
        if seq.prompt_logprobs is not None:  # rows predicting a prompt token not yet scored
            first = max(begin, len(seq.prompt_logprobs) - 1)
            for p in range(first, min(end, seq.num_prompt_tokens - 1)):
                prompt_rows.append(starts[-1] + p - begin)
                prompt_targets.append(seq.token_ids[p + 1])
                prompt_owners.append(seq)
        input_ids += seq.token_ids[begin:end]
        if seq.num_pending:  # its newest token (the last of this slice) is still on the device
            pending_at.append(len(input_ids))
            pending_rows.append(seq.pending_row)
            input_ids.append(0)
        positions += range(begin, end)
        if roles:
            prompt_tokens.append(max(0, min(end, seq.num_prompt_tokens) - begin))
        starts.append(starts[-1] + T)
        context_lens.append(end)
        if end == seq.num_tokens:
            sample_rows.append(starts[-1] - 1)
            sampling.append(seq)
    B, T_total, width = len(batch), len(input_ids), max(len(seq.block_table) for seq in batch.seqs)
    num_decodes = next((i for i, T in enumerate(batch.num_new_tokens) if T != 1), B)
    groups = attn.prefix_groups([seq.block_table for seq in batch.seqs[:num_decodes]], context_lens[:num_decodes])
    shared = [0] * B if groups else []
    for first, members, tokens in zip(groups[::3], groups[1::3], groups[2::3], strict=True):
        shared[first : first + members] = [tokens] * members
    layout = StepLayout(B, T_total, width, len(sample_rows), len(prompt_rows), len(pending_at),
                        max(batch.num_new_tokens), max(context_lens), num_decodes, len(groups) // 3, int(roles),
                        sum(prompt_tokens))
    tables = itertools.chain.from_iterable(seq.block_table + [0] * (width - len(seq.block_table))
                                           for seq in batch.seqs)
    parts = (input_ids, positions, starts, context_lens, sample_rows + prompt_rows, tables, pending_at, pending_rows,
             groups, shared, prompt_tokens)
    return StepLists(layout, parts, batch.num_new_tokens, sampling, prompt_targets, prompt_owners)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, attn: AttentionBackend, device: torch.device, graphs: DecodeGraphs | None = None,
        pieces: PiecewiseGraphs | None = None, tp: TensorParallel = SINGLE, sampling: SamplingState | None = None,
        mixed: MixedGraphs | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.device = device
        self.sampling = sampling  # rank 0's (the others never sample): the rows' settings, rules and token counts
        self.tp = tp  # the model's slice; rank 0 sends every step to the other ranks
        if any(g is not None and g.attn is not attn for g in (graphs, mixed, pieces)):
            raise ValueError("the CUDA graphs were captured over another KV pool")
        self.graphs = graphs  # decode steps replayed from CUDA graphs captured over `attn`
        self.mixed = mixed  # steps of decodes and a few prompts, whole
        self.pieces = pieces  # other steps replayed piecewise around `attn`

    def prepare(self, batch: ScheduledBatch, pending: torch.Tensor | None = None) -> StepInputs:
        """The step's inputs on the device (and on the other tensor-parallel ranks), sent in one copy; a request's
        newest token, if still pending, is read from `pending` (the last step's sampled ids [B'_last])."""
        return self.pack(gather(batch, self.attn), pending)

    def pack(self, lists: StepLists, pending: torch.Tensor | None) -> StepInputs:
        """`lists` into one int64 buffer (each part padded to an even length, the slots derived from the block
        tables and positions at the end), copied to the device in one transfer; the pending rows filled there."""
        layout, at = lists.layout, lists.layout.offsets
        ints = np.fromiter(itertools.chain.from_iterable(itertools.chain(part, [0] * (n % 2))
                                                         for part, n in zip(lists.parts, layout.sizes[:-1],
                                                                            strict=True)),
                           np.int64)
        P, B, width = self.attn.block_size, layout.B, layout.width
        pos = ints[at[1] : at[1] + layout.T_total]
        owner = np.repeat(np.arange(B), lists.num_new_tokens)  # each new token's request, in order
        slots = ints[at[5] : at[5] + B * width].reshape(B, width)[owner, pos // P] * P + pos % P
        host = torch.from_numpy(np.concatenate([ints, slots]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(self.device, non_blocking=True)
        x = layout.views(flat)
        if layout.num_pending:
            x.input_ids.index_copy_(0, x.pending_at, pending.index_select(0, x.pending_from))
        if self.tp.size > 1:
            dist.broadcast(torch.tensor(layout.header, device=self.device), 0)
            dist.broadcast(flat, 0)  # the pending tokens filled in
        return StepInputs(x, lists)

    def forward(self, x: StepTensors) -> torch.Tensor:
        """One forward pass -> logits [B' + prompt rows, V] of the step's logit rows, in the activations' dtype
        (every rank runs it)."""
        if self.graphs is not None and self.graphs.serves(x.meta):
            hidden = self.graphs.forward(x.input_ids, x.positions, x.meta)  # [B, E]
        elif self.mixed is not None and self.mixed.serves(x.meta):
            hidden = self.mixed.forward(x.input_ids, x.positions, x.meta)  # [T_total, E]
        elif self.pieces is not None and self.pieces.serves(x.meta):
            hidden = self.pieces.forward(x.input_ids, x.positions, x.meta)  # [T_total, E]
        else:
            hidden = self.model(x.input_ids, x.positions, self.attn, self.attn.prepare(x.meta))  # [T_total, E]
        return self.model.logits(hidden[x.logit_rows])

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch, last: Launched | None = None) -> Forwarded:
        """Queue `batch`'s forward pass on the device (`last`: the step before, whose ids may still be pending)
        -> the step with its logits on the way; `launch_sampling` queues the rest."""
        step = self.prepare(batch, last.tokens if last is not None else None)
        return Forwarded(step.lists, self.forward(step.tensors))

    @torch.inference_mode()
    def launch_sampling(self, step: Forwarded) -> Launched:
        """Queue the sampling of a step whose forward pass is queued -> the step in flight. Its rows' logit rules
        are built here, on the host, while the device runs the forward (a grammar's mask from the tokens landed so
        far); logprobs, when asked for, are computed here."""
        x, logits = step.lists, step.logits
        n = len(x.sampling)
        sampled = logits[:n]
        rules = self.sampling.rules(x.sampling)
        tokens = sample(sampled, self.sampling.settings(x.sampling), rules)
        if rules is not None:
            self.sampling.count(rules, tokens)
        cuda = self.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=cuda).copy_(tokens, non_blocking=cuda)
        copied = torch.cuda.Event() if cuda else None
        if copied is not None:
            copied.record()
        asking = [i for i, s in enumerate(x.sampling) if s.params.logprobs is not None]
        if not asking and not x.prompt_owners:
            return Launched(x.sampling, tokens, host, copied, [None] * n, [])
        entries = logprob_entries(
            torch.cat([logits[asking], logits[n:]]).float(),
            torch.cat([tokens[asking], device_tensor(x.prompt_targets, torch.int64, self.device)]),
            [x.sampling[i].params.logprobs for i in asking] + [s.params.prompt_logprobs for s in x.prompt_owners],
        )
        per_sampled: list[Entries | None] = [None] * n
        for i, e in zip(asking, entries, strict=False):
            per_sampled[i] = e
        return Launched(x.sampling, tokens, host, copied, per_sampled,
                        list(zip(x.prompt_owners, entries[len(asking) :], strict=True)))

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..size-1: run each step rank 0 sends, until it sends an empty one."""
        header = torch.empty(len(fields(StepLayout)), dtype=torch.int64, device=self.device)
        while True:
            dist.broadcast(header, 0)
            layout = StepLayout(*header.tolist())
            if layout.B == 0:
                return
            flat = torch.empty(layout.numel, dtype=torch.int64, device=self.device)
            dist.broadcast(flat, 0)
            self.forward(layout.views(flat))

    def stop_ranks(self) -> None:
        """Rank 0: tell the other ranks there are no more steps."""
        dist.broadcast(torch.zeros(len(fields(StepLayout)), dtype=torch.int64, device=self.device), 0)

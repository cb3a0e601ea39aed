"""Sampler: the next token of every row of logits at once, greedy or with temperature / min-p / top-k / top-p,
after the rows' logit rules (allowed tokens, bans and biases, penalties: `adjust`).

No loop over rows: each row's settings are a tensor. A sampled row draws by the Gumbel-max trick
(argmax of its filtered, scaled logits plus Gumbel noise is a draw from their softmax). A seeded
row's noise is a hash of (seed, the position it samples, the token id), so its tokens are the same
whatever shares its batch and however the engine stepped there; an unseeded row's is torch.rand.
A batch of greedy rows only takes the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weft.layers.fused import on_kernels

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # < 2**31: a 32-bit value times it never overflows int64


@dataclass
class SamplingTensors:
    """The per-row settings of one step's B sampled rows (all on the logits' device)."""

    temperature: torch.Tensor  # [B] float32; 0: greedy
    top_k: torch.Tensor  # [B] int64; V keeps every token
    top_p: torch.Tensor  # [B] float32; 1 keeps every token
    min_p: torch.Tensor  # [B] float32; 0 keeps every token
    seeded: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B, 2] int64: a seeded row's seed, low and high 32 bits
    position: torch.Tensor  # [B] int64: the position of the token each row samples
    max_top_k: int  # the largest row's top_k (V when a row keeps every token): only that many are ranked
    filtered: bool  # whether any row has a top_k, top_p or min_p that drops tokens (else none is ranked at all)


@dataclass
class LogitRules:
    """What changes the logits of some of a step's B sampled rows before they are sampled (on their device)."""

    allowed_rows: torch.Tensor  # [A] int64: rows that may sample only some tokens
    allowed: torch.Tensor  # [A, V] bool: those tokens
    bias_rows: torch.Tensor  # [K] int64: (row, token, bias) entries, added to the logits; -inf bans a token
    bias_tokens: torch.Tensor  # [K] int64
    bias: torch.Tensor  # [K] float32
    penalty_rows: torch.Tensor  # [R] int64: rows of requests with a penalty
    count_rows: torch.Tensor  # [R] int64: each one's row of counts and in_prompt
    counts: torch.Tensor  # [C, V] int32: each token's count in a request's output so far (C >= R rows)
    in_prompt: torch.Tensor  # [C, V] bool: the token is in the request's prompt
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor  # [R] float32


def adjust(logits: torch.Tensor, rules: LogitRules) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> [B, V] float32 with the rules applied, in vLLM's order: the allowed
    tokens, the biases and bans, then the repetition penalty (a seen token's logit divided by it if positive,
    multiplied if not), the frequency penalty (times the token's count) and the presence penalty (once)."""
    logits = logits.to(torch.float32, copy=True)  # a copy: the raw logits stay as they are, for logprobs
    if rules.allowed_rows.numel():
        rows = logits[rules.allowed_rows].masked_fill_(~rules.allowed, float("-inf"))
        logits[rules.allowed_rows] = rows
    if rules.bias_rows.numel():
        logits.index_put_((rules.bias_rows, rules.bias_tokens), rules.bias, accumulate=True)
    if rules.penalty_rows.numel():
        if on_kernels(logits):
            penalize(logits, rules)
        else:
            counts = rules.counts[rules.count_rows]  # [R, V]
            x = logits[rules.penalty_rows]
            rep = rules.repetition[:, None]
            seen = rules.in_prompt[rules.count_rows] | (counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x -= rules.frequency[:, None] * counts + rules.presence[:, None] * (counts > 0)
            logits[rules.penalty_rows] = x
    return logits


@triton.jit
def _penalize_kernel(
    logits_ptr, rows_ptr, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
    repetition_ptr, V, stride_l, stride_c, BLOCK: tl.constexpr,
):
    r, chunk = tl.program_id(0), tl.program_id(1)
    row, crow = tl.load(rows_ptr + r), tl.load(count_rows_ptr + r)
    col = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = col < V
    at = logits_ptr + row * stride_l + col
    x = tl.load(at, mask=mask, other=0.0)
    count = tl.load(counts_ptr + crow * stride_c + col, mask=mask, other=0)
    prompt = tl.load(in_prompt_ptr + crow * stride_c + col, mask=mask, other=0)
    rep = tl.load(repetition_ptr + r)
    # div_rn: IEEE division, as PyTorch's (Triton's `/` on float32 is an approximation)
    penalized = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    x = tl.where((prompt != 0) | (count > 0), penalized, x)
    x -= tl.load(frequency_ptr + r) * count.to(tl.float32) + tl.load(presence_ptr + r) * (count > 0).to(tl.float32)
    tl.store(at, x, mask=mask)


def penalize(logits: torch.Tensor, rules: LogitRules) -> None:
    """The repetition, frequency and presence penalties on logits [B, V] float32, in place, in one pass over
    the penalized rows' logits and counts (the same values as the PyTorch ops `adjust` runs off CUDA)."""
    R, (_, V) = rules.penalty_rows.numel(), logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and rules.counts.stride(1) == 1
    BLOCK = 4096
    _penalize_kernel[(R, triton.cdiv(V, BLOCK))](
        logits, rules.penalty_rows, rules.count_rows, rules.counts, rules.in_prompt.view(torch.uint8),
        rules.presence, rules.frequency, rules.repetition, V, logits.stride(0), rules.counts.stride(0),
        BLOCK=BLOCK, enable_fp_fusion=False,
    )


def sample(logits: torch.Tensor, t: SamplingTensors | None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] int64; `t` None: every row is greedy.

    Greedy rows take the argmax of the logits as they are: converting them to float32 first (as HF
    does) changes no value, so no argmax; the draws are computed in float32."""
    greedy = logits.argmax(dim=-1)
    if t is None:
        return greedy
    B, V = logits.shape
    temperature = t.temperature.clamp_min(1e-6)[:, None]
    if not t.filtered:  # every token kept: the Gumbel-max draw over all of them, by token id, needs no ranking
        scaled = logits / temperature  # float32: the temperature's dtype, in one pass
        ids = torch.arange(V, device=logits.device).expand(B, V)
        u = torch.where(t.seeded[:, None], hashed_uniform(t.seed, t.position, ids), torch.rand_like(scaled))
        return torch.where(t.temperature == 0, greedy, (scaled - torch.log(-torch.log(u))).argmax(dim=-1))
    # [B, K] and the token id at each rank; no row keeps a token past the largest top_k, so only K are ranked.
    # A positive temperature keeps the order, so the logits are ranked as they are (no float32 copy of [B, V])
    # and only the K kept are scaled: the same values as scaling all first.
    K = min(t.max_top_k, V)
    top, order = logits.topk(K, dim=-1) if K < V else logits.sort(dim=-1, descending=True)
    ordered = top / temperature  # float32
    rank = torch.arange(K, device=logits.device)
    drop = rank[None, :] >= t.top_k[:, None]
    # min-p keeps the tokens at least min_p times as likely as the likeliest (ordered[:, 0]), after temperature;
    # log(0) = -inf keeps every token
    drop |= ordered < ordered[:, :1] + t.min_p.log()[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (the token crossing it included)
    drop |= probs.cumsum(dim=-1) - probs >= t.top_p[:, None]
    u = torch.where(t.seeded[:, None], hashed_uniform(t.seed, t.position, order), torch.rand_like(ordered))
    gumbel = -torch.log(-torch.log(u))
    pick = (ordered.masked_fill(drop, float("-inf")) + gumbel).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, pick)[:, 0]
    return torch.where(t.temperature == 0, greedy, sampled)


def hashed_uniform(seed: torch.Tensor, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """seed [B, 2], position [B], token ids [B, K] (int64) -> uniforms in (0, 1) [B, K] float32, a hash of
    all three: the same arguments give the same values on any device."""
    x = _mix(seed[:, 0] ^ _mix(seed[:, 1]))
    x = _mix(x ^ (position & MASK32))[:, None]
    x = _mix(x ^ (token & MASK32))
    return (x.to(torch.float64) + 0.5).div_(2.0**32).to(torch.float32).clamp_(1e-7, 1 - 1e-7)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    x = ((x >> 16) ^ x) * HASH_MUL & MASK32
    return (x >> 16) ^ x

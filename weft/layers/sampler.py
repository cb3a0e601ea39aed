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

from weft.layers.bitmask import allowed_tokens
from weft.layers.fused import on_kernels
from weft.utils import cdiv

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # < 2**31: a 32-bit value times it never overflows int64
_HASH_MUL = tl.constexpr(HASH_MUL)  # the same, for the kernels


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
    allowed: torch.Tensor  # [A, ceil(V / 32)] int32: those tokens, a bitmask (weft.layers.bitmask)
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

    @property
    def penalties_only(self) -> bool:
        """Whether penalties are its only rules (no allowed tokens, biases or bans)."""
        return not self.allowed_rows.numel() and not self.bias_rows.numel()


def adjust(logits: torch.Tensor, rules: LogitRules) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> [B, V] float32 with the rules applied, in vLLM's order: the allowed
    tokens, the biases and bans, then the repetition penalty (a seen token's logit divided by it if positive,
    multiplied if not), the frequency penalty (times the token's count) and the presence penalty (once)."""
    logits = logits.to(torch.float32, copy=True)  # a copy: the raw logits stay as they are, for logprobs
    if rules.allowed_rows.numel():
        if on_kernels(logits):
            ban_unset(logits, rules.allowed_rows, rules.allowed)
        else:
            rows = logits[rules.allowed_rows].masked_fill_(~allowed_tokens(rules.allowed, logits.shape[1]),
                                                            float("-inf"))
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
def _ban_unset_kernel(logits_ptr, rows_ptr, bitmask_ptr, V, stride_l, stride_b, BLOCK: tl.constexpr):
    """-inf into logits row rows[a] at the columns of chunk `chunk` whose bit in bitmask[a] is 0."""
    a, chunk = tl.program_id(0), tl.program_id(1)
    col = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = col < V
    word = tl.load(bitmask_ptr + a * stride_b + col // 32, mask=ok, other=-1)
    unset = ((word >> (col % 32)) & 1) == 0  # an arithmetic shift: bit 31 (the sign) reads as 1 too
    row = tl.load(rows_ptr + a)
    tl.store(logits_ptr + row * stride_l + col, tl.full((BLOCK,), float("-inf"), tl.float32), mask=ok & unset)


def ban_unset(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] float32, in place: -inf at the tokens bitmask [A, ceil(V / 32)] int32 leaves unset in rows
    [A] int64, in one launch that reads the bitmask as it is (no [A, V] mask is built)."""
    (A, W), (_, V) = bitmask.shape, logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.stride(1) == 1 and W == cdiv(V, 32)
    BLOCK = 4096
    _ban_unset_kernel[(A, triton.cdiv(V, BLOCK))](logits, rows, bitmask, V, logits.stride(0), bitmask.stride(0),
                                                  BLOCK=BLOCK)


@triton.jit
def _penalized(x, col, mask, r, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
               repetition_ptr, stride_c):
    """x (float32, a tile of a row at columns `col`) with the penalties of penalty row r, as `adjust`'s PyTorch ops
    compute them (launched with enable_fp_fusion=False, so no multiply-add is contracted)."""
    crow = tl.load(count_rows_ptr + r)
    count = tl.load(counts_ptr + crow * stride_c + col, mask=mask, other=0)
    prompt = tl.load(in_prompt_ptr + crow * stride_c + col, mask=mask, other=0)
    rep = tl.load(repetition_ptr + r)
    # div_rn: IEEE division, as PyTorch's (Triton's `/` on float32 is an approximation)
    penalized = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    x = tl.where((prompt != 0) | (count > 0), penalized, x)
    return x - (tl.load(frequency_ptr + r) * count.to(tl.float32) +
                tl.load(presence_ptr + r) * (count > 0).to(tl.float32))


@triton.jit
def _penalize_kernel(
    logits_ptr, rows_ptr, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
    repetition_ptr, V, stride_l, stride_c, BLOCK: tl.constexpr,
):
    r, chunk = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows_ptr + r)
    col = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = col < V
    at = logits_ptr + row * stride_l + col
    x = tl.load(at, mask=mask, other=0.0)
    x = _penalized(x, col, mask, r, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
                   repetition_ptr, stride_c)
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


DRAW_MAX_K = 1024  # the most ranked tokens the draw kernel takes (one program per row holds them all)
GROUP = 4096  # the columns of a row that one program of the group-top kernel ranks
GROUP_TOP_MAX_K = 256  # the largest top_k it ranks: at most this many runs of columns seed its threshold


def sample(logits: torch.Tensor, t: SamplingTensors | None, rules: LogitRules | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] int64, after `rules` (adjust's, if any); `t` None: every
    row is greedy.

    Greedy rows take the argmax of the logits as they are: converting them to float32 first (as HF
    does) changes no value, so no argmax; the draws are computed in float32. On CUDA each draw is one
    Triton kernel over the row (without ranking: one pass over its V logits; with it: over its K ranked
    ones) instead of some fifty PyTorch ops, the same arithmetic; a top_k of at most GROUP_TOP_MAX_K is
    ranked by `group_top`, which also applies penalties (the only rules then) as it reads the logits."""
    B, V = logits.shape
    kernels = on_kernels(logits)
    K = min(t.max_top_k, V) if t is not None else V
    grouped = kernels and t is not None and t.filtered and K <= GROUP_TOP_MAX_K  # ranked by group_top
    if rules is not None and not (grouped and rules.penalties_only):
        logits, rules = adjust(logits, rules), None
    if t is None:
        return logits.argmax(dim=-1)
    if not t.filtered:  # every token kept: the Gumbel-max draw over all of them, by token id, needs no ranking
        if kernels:
            return gumbel_max(logits, t)
        scaled = logits / t.temperature.clamp_min(1e-6)[:, None]  # float32: the temperature's dtype, in one pass
        ids = torch.arange(V, device=logits.device).expand(B, V)
        u = torch.where(t.seeded[:, None], hashed_uniform(t.seed, t.position, ids), torch.rand_like(scaled))
        drawn = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
        return torch.where(t.temperature == 0, logits.argmax(dim=-1), drawn)
    # [B, K] and the token id at each rank, equal values by id (order[:, 0] is the argmax); no row keeps a token
    # past the largest top_k, so only K are ranked. A positive temperature keeps the order, so the logits are
    # ranked as they are (no float32 copy of [B, V]) and only the K kept are scaled: the same values as scaling
    # all first.
    if grouped:
        top, order = group_top(logits, K, rules)
    else:
        top, order = (ranked[:, :K] for ranked in logits.sort(dim=-1, descending=True, stable=True))
    greedy = order[:, 0].contiguous()
    if kernels and K <= DRAW_MAX_K:
        return _launch(_draw_kernel, top, order, greedy, t, K, K_P2=triton.next_power_of_2(K))
    ordered = top / t.temperature.clamp_min(1e-6)[:, None]  # float32
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


def group_top(logits: torch.Tensor, K: int, rules: LogitRules | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> each row's K largest, float32 [B, K] in descending order, and their ids
    [B, K] int64, equal values by ascending id (so ids[:, 0] is the argmax); with `rules` (penalties only: see
    LogitRules.penalties_only), those of the penalized logits, computed as each tile is read (no float32 copy of
    [B, V]). Each group of GROUP columns (a narrower vocabulary: one group) hands on at most 2K candidates, its K
    largest among them, and one stable sort of all candidates ranks them."""
    B, V = logits.shape
    assert 1 <= K <= GROUP_TOP_MAX_K and logits.stride(1) == 1
    chunks = min(GROUP_TOP_MAX_K, 2 * triton.next_power_of_2(K))
    group = min(GROUP, triton.next_power_of_2(max(V, chunks)))  # a narrow vocabulary in one group of its width
    G, CAP = triton.cdiv(V, group), 2 * K
    values = torch.empty(B, G * CAP, dtype=torch.float32, device=logits.device)
    ids = torch.empty(B, G * CAP, dtype=torch.int64, device=logits.device)
    penalize = rules is not None and rules.penalty_rows.numel() > 0
    if penalize:
        assert rules.penalties_only and rules.counts.stride(1) == 1
        penalty_of = torch.full((B,), -1, dtype=torch.int64, device=logits.device)  # each row's penalty row, or -1
        penalty_of.index_copy_(0, rules.penalty_rows, torch.arange(rules.penalty_rows.numel(), device=logits.device))
        p = (penalty_of, rules.count_rows, rules.counts, rules.in_prompt.view(torch.uint8), rules.presence,
             rules.frequency, rules.repetition, rules.counts.stride(0))
    else:
        p = (logits, logits, logits, logits, logits, logits, logits, 0)  # never read
    _group_top_kernel[(B, G)](logits, *p[:-1], values, ids, V, K, logits.stride(0), p[-1], values.stride(0),
                              GROUP=group, CHUNKS=chunks, CAP_P2=triton.next_power_of_2(CAP),
                              PENALIZE=penalize, enable_fp_fusion=False, num_warps=8)
    top, at = values.sort(dim=-1, descending=True, stable=True)
    return top[:, :K], ids.gather(1, at[:, :K])


@triton.jit
def _group_top_kernel(
    logits_ptr, penalty_of_ptr, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
    repetition_ptr, values_ptr, ids_ptr, V, K, stride_l, stride_c, stride_o, GROUP: tl.constexpr,
    CHUNKS: tl.constexpr, CAP_P2: tl.constexpr, PENALIZE: tl.constexpr,
):
    """Group g of a row: candidates (values, penalized first with PENALIZE, and ids) into the row's slots
    [g CAP, (g + 1) CAP), CAP = 2K: every value above a threshold t, then as many equal to t as fit, each kind in
    id order (so a stable sort of all the slots ranks equal values by id), -inf in the slots left. t, on integer
    keys in the values' order, is one that at least K and at most CAP keys reach (the K-th largest where more are
    equal), or every key of a group of fewer. Columns past V are never candidates."""
    row, g = tl.program_id(0), tl.program_id(1)
    col = g * GROUP + tl.arange(0, GROUP)
    ok = col < V
    x = tl.load(logits_ptr + row * stride_l + col, mask=ok, other=float("-inf")).to(tl.float32)
    if PENALIZE:
        r = tl.load(penalty_of_ptr + row)
        if r >= 0:
            x = _penalized(x, col, ok, r, count_rows_ptr, counts_ptr, in_prompt_ptr, presence_ptr, frequency_ptr,
                           repetition_ptr, stride_c)
    x = tl.where(ok, x + 0.0, float("-inf"))  # + 0.0: -0.0 becomes 0.0, one key for equal values
    bits = x.to(tl.int32, bitcast=True)
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # integers in the values' order
    key = tl.where(ok, key, -(1 << 40))  # columns past V: below every value's key, never counted
    CAP = 2 * K
    # a first threshold: the K-th largest of the maxima of CHUNKS runs of columns (K <= CHUNKS), at least the least
    # key: at least K keys reach it (one in each of K chunks), or every key does; for independent keys of any spread
    # about 1.3 K of them do (K = 50 of 4096 in chunks of 32: the 50th of 128 maxima, their 61st percentile)
    maxima = tl.max(tl.reshape(key, (CHUNKS, GROUP // CHUNKS)), 1)
    ranked = tl.sort(maxima, descending=True)
    lo = tl.sum(tl.where(tl.arange(0, CHUNKS) == K - 1, ranked, 0), 0)
    lo = tl.maximum(lo, tl.min(tl.where(ok, key, 1 << 40), 0))
    hi = tl.max(key, 0)  # the K-th largest is <= hi
    n_lo = tl.sum((key >= lo).to(tl.int32), 0)  # >= K, or every key of the group (fewer than K)
    while (lo < hi) & (n_lo > CAP):  # too many reach it: bisect (all keys equal in some places, say)
        mid = lo + (hi - lo + 1) // 2
        n = tl.sum((key >= mid).to(tl.int32), 0)
        enough = n >= K
        lo = tl.where(enough, mid, lo)
        n_lo = tl.where(enough, n, n_lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tie = key == lo
    n_above = tl.sum(above.to(tl.int32), 0)
    slot = tl.where(above, tl.cumsum(above.to(tl.int32), 0) - 1, n_above + tl.cumsum(tie.to(tl.int32), 0) - 1)
    keep = (above | tie) & (slot < CAP)
    base = row * stride_o + g * CAP
    tl.store(values_ptr + base + slot, x, mask=keep)
    tl.store(ids_ptr + base + slot, col.to(tl.int64), mask=keep)
    spare = tl.arange(0, CAP_P2)
    left = (spare >= tl.minimum(n_lo, CAP)) & (spare < CAP)
    tl.store(values_ptr + base + spare, float("-inf"), mask=left)
    tl.store(ids_ptr + base + spare, g * GROUP, mask=left)


def _launch(kernel, values: torch.Tensor, ids: torch.Tensor, greedy: torch.Tensor, t: SamplingTensors, width: int,
            **constexprs: int) -> torch.Tensor:
    """One program per row of values [B, width]: a draw kernel's launch -> token ids [B] int64."""
    B = values.shape[0]
    assert values.stride(1) == 1 and ids.stride(1) == 1
    out = torch.empty(B, dtype=torch.int64, device=values.device)
    kernel[(B,)](values, ids, greedy, t.temperature, t.top_k, t.top_p, t.min_p, t.seeded.view(torch.int8), t.seed,
                 t.position, out, width, values.stride(0), ids.stride(0), *t.seed.stride(), _step_seed(),
                 **constexprs)
    return out


def _step_seed() -> int:
    """The Philox seed of a step's unseeded rows, drawn from torch's CPU generator (on the host: no device sync)."""
    return int(torch.randint(2**31 - 1, ()))


GUMBEL_CHUNK = 4096  # the columns of a row one program of the Gumbel-max draw takes


def gumbel_max(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64: each row's argmax of logit / T + Gumbel noise (T = 0: of the logits),
    the first of equal ones, as `sample`'s PyTorch ops draw with nothing filtered.

    A program per GUMBEL_CHUNK columns of a row leaves its chunk's best score and id; the argmax over the chunks
    (the first of equal ones, so the lowest id) picks the row's. One program per row would walk V alone: at
    V = 151,936 and B = 64, about a third of a millisecond a step."""
    (B, V), C = logits.shape, triton.cdiv(logits.shape[1], GUMBEL_CHUNK)
    assert logits.stride(1) == 1
    best = torch.empty(B, C, dtype=torch.float32, device=logits.device)
    at = torch.empty(B, C, dtype=torch.int64, device=logits.device)
    _gumbel_max_kernel[(B, C)](logits, t.temperature, t.seeded.view(torch.int8), t.seed, t.position, best, at, V,
                               logits.stride(0), best.stride(0), *t.seed.stride(), _step_seed(),
                               CHUNK=GUMBEL_CHUNK, num_warps=8)
    return at.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]


@triton.jit
def _mix32(x):
    """_mix in the kernels, on uint32 (whose products wrap at 2**32, as _mix's masks do)."""
    x = ((x >> 16) ^ x) * _HASH_MUL
    x = ((x >> 16) ^ x) * _HASH_MUL
    return (x >> 16) ^ x


@triton.jit
def _uniforms(seed_ptr, stride_s0, stride_s1, position_ptr, seeded, row, tokens, offsets, step_seed):
    """hashed_uniform of the row's tokens (int32 or int64, below 2**31) where it is seeded, else Philox uniforms at
    `offsets`: only the one the row needs is computed."""
    if seeded != 0:
        low = tl.load(seed_ptr + row * stride_s0).to(tl.uint32)
        high = tl.load(seed_ptr + row * stride_s0 + stride_s1).to(tl.uint32)
        h = _mix32(_mix32(low ^ _mix32(high)) ^ tl.load(position_ptr + row).to(tl.uint32))
        x = _mix32(h ^ tokens.to(tl.uint32))
        u = ((x.to(tl.float64) + 0.5) * 2.3283064365386963e-10).to(tl.float32)  # / 2**32: exact, as hashed_uniform's
        u = tl.minimum(tl.maximum(u, 1e-7), 1 - 1e-7)
    else:
        u = tl.rand(step_seed, offsets)
    return u


@triton.jit(do_not_specialize=["step_seed"])  # a new seed every step: never a recompile
def _gumbel_max_kernel(
    logits_ptr, temperature_ptr, seeded_ptr, seed_ptr, position_ptr, best_ptr, at_ptr, V, stride_l, stride_b,
    stride_s0, stride_s1, step_seed, CHUNK: tl.constexpr,
):
    """Chunk c of row r: the best of logit / T + Gumbel noise over its columns (T = 0: of the logits, no noise
    drawn) and its id, the first of equal ones."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    T = tl.load(temperature_ptr + row)
    col = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = col < V
    x = tl.load(logits_ptr + row * stride_l + col, mask=ok, other=float("-inf")).to(tl.float32)
    if T != 0:
        u = _uniforms(seed_ptr, stride_s0, stride_s1, position_ptr, tl.load(seeded_ptr + row), row, col,
                      row * V + col, step_seed)
        x = tl.where(ok, tl.math.div_rn(x, tl.maximum(T, 1e-6)) - tl.log(-tl.log(u)), float("-inf"))
    tl.store(best_ptr + row * stride_b + chunk, tl.max(x, 0))
    tl.store(at_ptr + row * stride_b + chunk, chunk * CHUNK + tl.argmax(x, 0, tie_break_left=True).to(tl.int64))


@triton.jit(do_not_specialize=["step_seed"])
def _draw_kernel(
    top_ptr, order_ptr, greedy_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeded_ptr, seed_ptr,
    position_ptr, out_ptr, K, stride_t, stride_o, stride_s0, stride_s1, step_seed, K_P2: tl.constexpr,
):
    """Row r's token from its K ranked logits (top, in descending order) and their ids (order), as `sample`'s
    PyTorch ops do: scaled by 1 / T, cut by top_k, min_p and top_p, then the Gumbel-max draw; T = 0: greedy's."""
    row = tl.program_id(0)
    rank = tl.arange(0, K_P2)
    ok = rank < K
    T = tl.load(temperature_ptr + row)
    x = tl.math.div_rn(tl.load(top_ptr + row * stride_t + rank, mask=ok, other=float("-inf")).to(tl.float32),
                       tl.maximum(T, 1e-6))
    drop = (rank >= tl.load(top_k_ptr + row)) | ~ok
    first = tl.max(tl.where(rank == 0, x, float("-inf")), 0)
    drop = drop | (x < first + tl.log(tl.load(min_p_ptr + row)))
    kept = tl.where(drop, float("-inf"), x)
    e = tl.exp(kept - tl.max(kept, 0))
    probs = e / tl.sum(e, 0)
    drop = drop | (tl.cumsum(probs, 0) - probs >= tl.load(top_p_ptr + row))
    ids = tl.load(order_ptr + row * stride_o + rank, mask=ok, other=0)
    u = _uniforms(seed_ptr, stride_s0, stride_s1, position_ptr, tl.load(seeded_ptr + row), row, ids,
                  row * K_P2 + rank, step_seed)
    score = tl.where(drop, float("-inf"), x) - tl.log(-tl.log(u))
    pick = tl.argmax(score, 0, tie_break_left=True)
    token = tl.sum(tl.where(rank == pick, ids, 0), 0)
    tl.store(out_ptr + row, tl.where(T == 0, tl.load(greedy_ptr + row), token))


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

"""Attention over a padded batch with torch SDPA: the math the contiguous and paged backends share.

Both read each request's keys into a padded [B, H_kv, S, D] tensor (by slicing rows or by
gathering blocks); this module pads the ragged queries to match, masks, and unpads.

SDPA's kernels pick their blocking from the padded shape, so a query's sums follow its batch. Batch-invariant
(EngineConfig.deterministic), `attend_invariant` computes the same attention with every product in matmuls of
one fixed shape (ROWS queries by KEY_TILE keys; linear.py's reason) and exp from correctly rounded operations
(exact.py's reason), folding each query's keys a tile at a time from position 0 by an online softmax: tiles past
a query's keys add exact zeros, so its bits are the same whatever the batch, the padding, or the chunk it came in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weft.attention.base import AttentionMetadata
from weft.layers import exact
from weft.layers.linear import ROWS

KEY_TILE = 64  # keys per step of attend_invariant's online softmax


@dataclass
class PaddedStep:
    """Per-step indices for padding; built once per step, used by every layer."""

    meta: AttentionMetadata
    token_request: torch.Tensor  # [T_total] int64: request b of each new token
    token_index: torch.Tensor  # [T_total] int64: its row i among request b's T_b new tokens
    mask: torch.Tensor  # [B, 1, T_max, S] bool: query i of request b may see key j
    # the same within the model's sliding window, for the layers that have one: [B, 1, T_max, S] over positions from
    # 0, or [B, 1, T_max, S_w] over the keys a paged backend gathers from window_start
    window_mask: torch.Tensor | None
    window_slots: torch.Tensor | None = None  # [B, S_w] int64: the paged slab's rows of those keys


def plan_padded(
    meta: AttentionMetadata, window: int | None = None, window_start: torch.Tensor | None = None, window_keys: int = 0
) -> PaddedStep:
    """The step's padding and masks; `window`: the keys a query sees at most, itself included (HF's sliding
    window: key j is seen from position p when p - window < j <= p); `window_start` [B] int64: the position of the
    first of the `window_keys` keys request b's window layers read (None: every key from 0)."""
    starts = meta.query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]  # [B]
    B, T_total = meta.num_requests, meta.slot_mapping.shape[0]
    device = starts.device
    token_request = torch.repeat_interleave(torch.arange(B, device=device), q_lens, output_size=T_total)
    token_index = torch.arange(T_total, device=device) - starts[token_request]
    ctx = meta.context_lens.long()
    i = torch.arange(meta.max_query_len, device=device)
    j = torch.arange(meta.max_context_len, device=device)
    last_visible = (ctx - q_lens)[:, None] + i[None, :]  # [B, T_max]: position of query row i
    mask, window_mask = visible(j[None], last_visible, ctx), None
    if window is not None:
        keys = j[None] if window_start is None else window_start[:, None] + torch.arange(window_keys, device=device)
        window_mask = visible(keys, last_visible, ctx) & (keys[:, None, :] > last_visible[:, :, None] - window)
        window_mask = window_mask[:, None]
    return PaddedStep(meta, token_request, token_index, mask[:, None], window_mask)


def visible(keys: torch.Tensor, last_visible: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """keys [B or 1, S] (positions), last_visible [B, T_max], ctx [B] -> [B, T_max, S] bool: each query row sees
    the key (it is in the cache and not after the query)."""
    return (keys[:, None, :] <= last_visible[:, :, None]) & (keys[:, None, :] < ctx[:, None, None])


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PaddedStep, scale: float, out: torch.Tensor | None,
    windowed: bool = False, invariant: bool = False,
) -> torch.Tensor:
    """q [T_total, H_q, D], k/v [B, H_kv, S, D] -> o [T_total, H_q, D] (copied into `out` if given); `windowed`:
    within the sliding window (step.window_mask); `invariant`: by `attend_invariant`."""
    meta = step.meta
    B, T_max = meta.num_requests, meta.max_query_len
    mask = step.window_mask if windowed else step.mask
    T_pad = -(-T_max // ROWS) * ROWS if invariant else T_max
    q_pad = q.new_zeros(B, T_pad, *q.shape[1:])
    q_pad[step.token_request, step.token_index] = q
    if invariant:
        o = attend_invariant(q_pad.transpose(1, 2), k, v, F.pad(mask, (0, 0, 0, T_pad - T_max)), scale)
    else:
        o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    o = o.transpose(1, 2)[step.token_request, step.token_index]  # from [B, H_q, T_pad, D]
    return o if out is None else out.copy_(o)


def attend_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """q [B, H_q, T, D] (T a multiple of ROWS), k/v [B, H_kv, S, D], mask [B, 1, T, S] -> o [B, H_q, T, D] (rows
    that see no key: NaN), each query's sums in the same order whatever B, T, S and its row."""
    B, H_q, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    G, blocks = H_q // H_kv, T // ROWS
    S_pad = -(-S // KEY_TILE) * KEY_TILE
    k, v = (F.pad(x, (0, 0, 0, S_pad - S)) for x in (k, v))
    mask = F.pad(mask, (0, S_pad - S)).view(B, 1, 1, blocks, ROWS, S_pad)
    q = q.reshape(B, H_kv, G, blocks, ROWS, D)
    m = q.new_full((B, H_kv, G, blocks, ROWS, 1), -1e30, dtype=torch.float32)  # finite: no -inf - -inf
    row_sum = torch.zeros_like(m)
    acc = q.new_zeros((B, H_kv, G, blocks, ROWS, D), dtype=torch.float32)
    X = B * H_q * blocks  # the fixed-shape matmuls per tile

    def tiles(x: torch.Tensor) -> torch.Tensor:  # [B, H_kv, S_pad, D] -> [X, KEY_TILE, D] of one tile, per block
        return x[:, :, None, None].expand(B, H_kv, G, blocks, KEY_TILE, D).reshape(X, KEY_TILE, D)

    for start in range(0, S_pad, KEY_TILE):
        end = start + KEY_TILE
        s = torch.bmm(q.reshape(X, ROWS, D), tiles(k[:, :, start:end]).transpose(1, 2)).float()
        s = (s.view(B, H_kv, G, blocks, ROWS, KEY_TILE) * scale).masked_fill(~mask[..., start:end], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = exact.exp(m - m_new)
        p = exact.exp(s - m_new)
        row_sum = row_sum * alpha + p.sum(-1, keepdim=True)
        pv = torch.bmm(p.to(v.dtype).view(X, ROWS, KEY_TILE), tiles(v[:, :, start:end])).float()
        acc = acc * alpha + pv.view(acc.shape)
        m = m_new
    return (acc / row_sum).to(q.dtype).view(B, H_q, T, D)

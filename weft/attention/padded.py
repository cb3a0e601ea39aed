"""Attention over a padded batch with torch SDPA: the math the contiguous and paged backends share.

Both read each request's keys into a padded [B, H_kv, S, D] tensor (by slicing rows or by
gathering blocks); this module pads the ragged queries to match, masks, and unpads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weft.attention.base import AttentionMetadata


@dataclass
class PaddedStep:
    """Per-step indices for padding; built once per step, used by every layer."""

    meta: AttentionMetadata
    token_request: torch.Tensor  # [T_total] int64: request b of each new token
    token_index: torch.Tensor  # [T_total] int64: its row i among request b's T_b new tokens
    mask: torch.Tensor  # [B, 1, T_max, S] bool: query i of request b may see key j
    window_mask: torch.Tensor | None  # the same within the model's sliding window, for the layers that have one


def plan_padded(meta: AttentionMetadata, window: int | None = None) -> PaddedStep:
    """The step's padding and masks; `window`: the keys a query sees at most, itself included (HF's sliding
    window: key j is seen from position p when p - window < j <= p)."""
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
    mask = (j[None, None, :] <= last_visible[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
    window_mask = None if window is None else mask & (j[None, None, :] > last_visible[:, :, None] - window)
    return PaddedStep(meta, token_request, token_index, mask[:, None],
                      None if window_mask is None else window_mask[:, None])


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: PaddedStep, scale: float, out: torch.Tensor | None,
    windowed: bool = False,
) -> torch.Tensor:
    """q [T_total, H_q, D], k/v [B, H_kv, S, D] -> o [T_total, H_q, D] (copied into `out` if given); `windowed`:
    within the sliding window (step.window_mask)."""
    meta = step.meta
    B, T_max = meta.num_requests, meta.max_query_len
    q_pad = q.new_zeros(B, T_max, *q.shape[1:])
    q_pad[step.token_request, step.token_index] = q
    o = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), k, v, attn_mask=step.window_mask if windowed else step.mask, scale=scale,
        enable_gqa=True,
    )  # [B, H_q, T_max, D]
    o = o.transpose(1, 2)[step.token_request, step.token_index]
    return o if out is None else out.copy_(o)

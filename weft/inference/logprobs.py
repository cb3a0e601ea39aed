"""Log-probabilities of chosen tokens and their likeliest alternatives, vLLM's `Logprob` entries.

Computed from the raw logits (before temperature, top-k or top-p: what the model says), in float32,
for the rows whose requests ask: the sampled tokens of `logprobs` requests and the prompt tokens of
`prompt_logprobs` ones. One log-softmax and one top-k over those rows, one copy to the host.
"""

from __future__ import annotations

import torch

from weft.inference.outputs import Logprob

Entries = list[tuple[int, float, int]]  # (token id, logprob, rank): the chosen token first, then the top k


def logprob_entries(logits: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[Entries]:
    """logits [R, V] float32, targets [R] int64, each row's k -> per row: its target and its top k."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, targets[:, None])  # [R, 1]
    rank = (logp > chosen).sum(dim=-1, keepdim=True) + 1  # 1: the likeliest
    k = max(ks)
    values, ids = [chosen], [targets[:, None], rank]
    if k:
        top = logp.topk(k, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    values, ids = torch.cat(values, 1).tolist(), torch.cat(ids, 1).tolist()  # [R, 1 + k], [R, 2 + k]
    return [
        [(row_ids[0], row_values[0], row_ids[1])] + [(row_ids[2 + j], row_values[1 + j], j + 1) for j in range(k_row)]
        for row_values, row_ids, k_row in zip(values, ids, ks, strict=True)
    ]


def as_dict(entries: Entries, decode) -> dict[int, Logprob]:
    """One position's entries as vLLM's {token id: Logprob}; `decode` (token id -> text) or None."""
    return {t: Logprob(lp, rank, decode([t]) if decode else None) for t, lp, rank in entries[::-1]}

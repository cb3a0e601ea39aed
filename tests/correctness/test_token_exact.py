"""weft's greedy tokens equal HF generate's: model x backend x scheduler x pool x arrivals."""

from __future__ import annotations

import pytest
import torch

from weft.attention import available_backends
from weft.conformance import Case, run_case
from weft.inference.scheduler import SCHEDULERS

pytestmark = pytest.mark.correctness

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EVERY_CASE = [
    Case(attention, scheduler, pool, midflight)
    for attention in available_backends(DEVICE)
    for scheduler in SCHEDULERS
    for pool in ("full", "small")
    for midflight in (False, True)
]


@pytest.mark.parametrize("case", EVERY_CASE, ids=lambda c: c.label)
def test_matches_hf(model, case, reference, device):
    ref = reference(model)
    result = run_case(
        model,  # by name: weft loads the weights its own way, HF its own
        case,
        ref.prompts,
        ref.expected,
        ref.max_tokens,
        "float32",
        device,
        ignore_eos=ref.ignore_eos,
    )
    mismatches = {p.index: p.divergence for p in result.prompts if p.divergence is not None}
    assert not mismatches, f"prompt -> first diverging token: {mismatches}"
    assert not result.problems

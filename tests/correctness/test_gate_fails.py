"""The gate can fail: a deliberately faulty cache write must be reported as a mismatch."""

from __future__ import annotations

import pytest

from tests.correctness.faults import OffByOneWrite
from weft import attention
from weft.conformance import Case, report_lines, run_case

pytestmark = pytest.mark.correctness


def test_faulty_cache_write_is_reported(monkeypatch, reference, device):
    monkeypatch.setitem(attention.BACKENDS, OffByOneWrite.name, OffByOneWrite)
    result = _check(reference, OffByOneWrite.name, device)
    assert not result.ok
    diverging = [p for p in result.prompts if p.divergence is not None]
    assert diverging, "the faulty backend went unnoticed"
    lines = list(report_lines(result, decode=lambda ids: " ".join(map(str, ids))))
    assert any(" FAIL at token " in line for line in lines)
    first = diverging[0]
    assert first.expected[: first.divergence] == first.got[: first.divergence]
    assert first.expected[first.divergence] != first.got[first.divergence]


def test_correct_backend_passes_same_check(reference, device):
    """The same check, on the real backend, passes: the failure above is the fault's doing."""
    result = _check(reference, "paged", device)
    assert result.ok
    assert all(len(p.got) == reference("tiny-llama").max_tokens for p in result.prompts)


def _check(reference, attention_name, device):
    ref = reference("tiny-llama")
    return run_case(
        ref.hf_model,
        Case(attention_name, "continuous"),
        ref.prompts,
        ref.expected,
        ref.max_tokens,
        "float32",
        device,
        ignore_eos=True,
    )

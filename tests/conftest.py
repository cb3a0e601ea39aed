"""Models and HF references shared by the correctness and server tests, loaded once per session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from weft.conformance import conformance_prompts, hf_reference
from weft.models.loader import ModelSource, reference_model, resolve_model


@dataclass
class Reference:
    source: ModelSource
    hf_model: object  # the transformers model with the same weights (float32, on the test device)
    prompts: list[list[int]]
    expected: list[list[int]]
    max_tokens: int
    ignore_eos: bool


_references: dict[tuple[str, torch.device], Reference] = {}


@pytest.fixture(scope="session")
def reference(device: torch.device):
    """reference(model_name) -> the model, its prompts and HF's greedy continuations, on the test device or on
    `on` (random weights are drawn on the device they are made on: each device's reference is its own)."""

    def get(name: str, on: torch.device = device) -> Reference:
        key = (name, on)
        if key not in _references:
            source = resolve_model(name)
            hf_model = reference_model(source, torch.float32, on)
            prompts = conformance_prompts(source, count=4 if source.tokenizer else 5)
            ignore_eos = source.tokenizer is None  # random weights: run to max_tokens
            expected = hf_reference(hf_model, prompts, 24, ignore_eos)
            _references[key] = Reference(source, hf_model, prompts, expected, 24, ignore_eos)
        return _references[key]

    return get

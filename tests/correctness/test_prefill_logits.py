"""weft's prefill logits equal HF's forward pass at every position (float32, allclose)."""

from __future__ import annotations

import pytest
import torch

from weft import LLM
from weft.inference.block_manager import BlockManager
from weft.inference.outputs import RequestMetrics
from weft.inference.params import SamplingParams
from weft.inference.runner import ModelRunner
from weft.inference.scheduler import ScheduledBatch
from weft.inference.sequence import Sequence
from weft.utils import cdiv

pytestmark = pytest.mark.correctness


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@torch.inference_mode()
def test_prefill_logits_match_hf(model, attention, reference, device):
    ref = reference(model)
    ids = max(ref.prompts, key=len)
    P = 8  # contiguous rows hold max_model_len tokens whatever P is
    engine = LLM(
        model, attention=attention, num_blocks=cdiv(len(ids), P), block_size=P, max_model_len=len(ids) + 1,
        device=device,
    ).llm_engine
    attn, weft_model = engine.runner.attn, engine.model
    seq = Sequence(0, list(ids), len(ids), SamplingParams(), len(ids) + 1, RequestMetrics(0.0))
    BlockManager(attn.num_blocks, attn.block_size).grow(seq, len(ids))
    batch = ScheduledBatch()
    batch.add(seq, len(ids))
    x = ModelRunner(weft_model, attn, device).prepare(batch).tensors
    logits = weft_model.logits(weft_model(x.input_ids, x.positions, attn, attn.prepare(x.meta))).float()  # [T, V]
    expected = ref.hf_model(torch.tensor([ids], device=device)).logits[0].float()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)

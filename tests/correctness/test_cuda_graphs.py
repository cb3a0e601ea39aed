"""Decode steps replayed from CUDA graphs give the tokens the eager forward gives."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.attention.paged import PagedBackend
from weft.benchmark.replay import Arrival, replay_ticks
from weft.inference.cuda_graphs import DecodeGraphs, graph_batch_sizes

pytestmark = pytest.mark.correctness


@pytest.mark.parametrize("max_batch", [1, 5, 16, 100, 256])
def test_batch_sizes_cover_every_batch(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
    # every batch has a size within 16 rows of padding (and within 2x for the small ones)
    for B in range(1, max_batch + 1):
        size = next(s for s in sizes if s >= B)
        assert size - B < 16 and size < 2 * B


def test_refuses_backend_without_graphs():
    engine = LLM("tiny-llama", attention="paged", num_blocks=8, block_size=4, device="cpu").llm_engine
    with pytest.raises(ValueError, match="paged attention cannot be captured"):
        DecodeGraphs(engine.model, PagedBackend(engine.model_config, 8, 4, torch.float32, torch.device("cpu")), 4, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_graphs_match_eager(reference, scheduler):
    """Batches of every size from 1 to 5 (arrivals staggered, outputs of different lengths), so
    graphs of sizes 1, 2, 4 and 8 replay with and without padding rows."""
    ref = reference("tiny-qwen3")
    prompts = ref.prompts[:5]
    params = [SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    arrivals = [0, 0, 2, 5, 9]
    outputs = {}
    for eager in (True, False):
        with LLM("tiny-qwen3", attention="triton", scheduler=scheduler, num_blocks=64, block_size=4,
                 max_num_seqs=8, dtype="float32", device="cuda", enforce_eager=eager) as llm:
            graphs = llm.llm_engine.runner.graphs
            assert (graphs is None) == eager
            zipped = zip(prompts, params, arrivals, strict=True)
            arrived = [Arrival(i, p, sp, tick) for i, (p, sp, tick) in enumerate(zipped)]
            outputs[eager] = [o.outputs[0].token_ids for o in replay_ticks(llm.llm_engine, arrived)]
            if not eager:
                assert graphs.sizes == [1, 2, 4, 8]
                assert graphs.replays > 0
    assert outputs[False] == outputs[True]

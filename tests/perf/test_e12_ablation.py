"""e12: the ablation. continuous x the configured backend with the engine's defaults (chunked prefill
at its 8,192-token budget, CUDA graphs for decode steps and piecewise ones for the others, prefix caching,
overlap, the fused layer kernels, the decode GEMMs' tuned launches), then each turned off in turn:
its share of e8's throughput and of a lone request's ITL (the report divides each by the defaults').
The lone request is also served by HF's fast path (the static cache, compiled on a GPU): the batch-1
ITL peer, in the same run."""

import pytest

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig
from weft.inference.config import CHUNKED_BUDGET

pytestmark = pytest.mark.perf

OFF = {"defaults": {}, "nochunks": dict(enable_chunked_prefill=False), "eager": dict(cudagraph_mode="NONE"),
       "nopiecewise": dict(cudagraph_mode="FULL_DECODE_ONLY"), "nocache": dict(enable_prefix_caching=False),
       "nooverlap": dict(enable_overlap=False), "nofused": dict(enable_fused_layers=False),
       "notuned": dict(enable_tuned_gemms=False)}


@pytest.mark.parametrize("off", OFF)
@pytest.mark.parametrize("shape", ["e8", "batch1"])
def test_e12_ablation(run_benchmark, sizes, model_for, shape, off):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    if shape == "e8":
        workload = workloads.standard(vocab, sizes.e8_requests, sizes.e8_lengths)
    else:
        workload = workloads.fixed(1, sizes.e12_prompt_len, sizes.e12_new_tokens, vocab)
    config = BenchConfig(options=dict(attention=sizes.attention, max_num_batched_tokens=CHUNKED_BUDGET, **OFF[off]))
    run_benchmark("e12", config, workload, model=sizes.model)


def test_e12_batch1_peer(run_benchmark, sizes, model_for):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    workload = workloads.fixed(1, sizes.e12_prompt_len, sizes.e12_new_tokens, vocab)
    run_benchmark("e12", BenchConfig(engine="hf_generate_static"), workload, model=sizes.model)

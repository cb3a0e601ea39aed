"""Benchmark configurations: their checks, labels, the engine options they give a workload, and those
options as `weft serve` flags."""

import pytest
import torch

from weft.benchmark import workloads
from weft.benchmark.runner import BenchConfig, engine_options
from weft.cli import build_parser, engine_flags
from weft.inference.config import CHUNKED_BUDGET


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(engine="vllm"), "unknown engine 'vllm'"),
        (dict(options=dict(scheduler="fifo")), "unknown scheduler"),
        (dict(options=dict(attention="flash")), "unknown attention"),
        (dict(options=dict(cudagraph_mode="ALL")), "unknown cudagraph_mode"),
        (dict(pool_fraction=0.0), "pool_fraction"),
        (dict(options=dict(prefix_caching=False, overlap=False)), "not EngineConfig fields: prefix_caching, overlap"),
        (dict(options=dict(num_blocks=8)), "num_blocks: set by the benchmark"),
        (dict(options=dict(dtype="float32", max_model_len=64)), "dtype, max_model_len: set by the benchmark"),
        (dict(engine="hf_generate", options=dict(attention="paged")), "hf_generate takes no engine options"),
    ],
)
def test_bench_config_refuses_what_it_cannot_run(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)


def test_bench_config_labels_and_ids():
    static = BenchConfig(options=dict(scheduler="static", attention="contiguous"))
    assert (static.label, static.id) == ("static×contiguous", "static-contiguous")
    assert BenchConfig(options=dict(attention="triton")).id == "continuous-triton"
    assert BenchConfig().label == "continuous×paged"
    assert BenchConfig(engine="hf_generate_batch").label == "hf_generate_batch"
    off = BenchConfig(options=dict(attention="triton", enable_overlap=False, enable_fused_layers=False))
    assert off.label == "continuous×triton, no overlap, no fused layers"
    assert off.id == "continuous-triton-nooverlap-nofused"
    every = BenchConfig(options=dict(enable_fused_layers=False, enable_overlap=False, enable_prefix_caching=False,
                                     cudagraph_mode="NONE", enable_chunked_prefill=False))
    assert every.label == ("continuous×paged, no chunked prefill, no CUDA graphs, no prefix cache, no overlap, "
                           "no fused layers")
    assert every.id == "continuous-paged-nochunks-eager-nocache-nooverlap-nofused"
    assert BenchConfig(options=dict(cudagraph_mode="FULL_DECODE_ONLY")).id == "continuous-paged-nopiecewise"
    assert BenchConfig(options=dict(enforce_eager=True)).id == "continuous-paged-eager"
    tuned = BenchConfig(options=dict(attention="triton", enable_tuned_gemms=False))
    assert (tuned.label, tuned.id) == ("continuous×triton, no tuned GEMMs", "continuous-triton-notuned")
    # only an explicit False is labelled: True and None are the defaults' own values
    assert BenchConfig(options=dict(enable_prefix_caching=None, enable_overlap=True)).label == "continuous×paged"
    # a step token budget is labelled unless it is the engine's own default
    budget = BenchConfig(options=dict(attention="triton", max_num_batched_tokens=1024, enable_overlap=False))
    assert budget.label == "continuous×triton, no overlap, budget 1024"
    assert budget.id == "continuous-triton-nooverlap-budget1024"
    assert BenchConfig(options=dict(max_num_batched_tokens=CHUNKED_BUDGET)).label == "continuous×paged"


def test_engine_options_size_the_engine_to_the_workload():
    w = workloads.uniform(6, (3, 40), (2, 9), vocab_size=256, seed=1, name="w")
    assert engine_options(BenchConfig(), w) == dict(
        num_blocks=w.blocks_needed(16), max_num_seqs=6, max_num_batched_tokens=w.input_tokens, max_model_len=w.max_len
    )
    shrunk = engine_options(BenchConfig(options=dict(block_size=8), pool_fraction=0.01), w)
    assert shrunk["num_blocks"] == w.largest_request_blocks(8) and shrunk["block_size"] == 8  # the longest fits
    rows = engine_options(BenchConfig(options=dict(attention="contiguous", max_num_seqs=2)), w)
    assert (rows["num_blocks"], rows["max_num_seqs"]) == (2, 2)  # a row per request it may hold
    given = engine_options(BenchConfig(options=dict(max_num_batched_tokens=32, enable_overlap=False)), w)
    assert (given["max_num_batched_tokens"], given["enable_overlap"]) == (32, False)
    with pytest.raises(ValueError, match="weft's"):
        engine_options(BenchConfig(engine="hf_generate"), w)


def test_engine_flags_round_trip_through_weft_serve():
    options = dict(attention="triton", scheduler="static", block_size=32, num_blocks=100, max_num_seqs=7,
                   gpu_memory_utilization=0.5, enable_chunked_prefill=False, enable_overlap=True,
                   enable_prefix_caching=False, cudagraph_mode="NONE", max_model_len=None)
    flags = engine_flags(options)
    assert "--no-enable-chunked-prefill" in flags and "--enable-overlap" in flags and "--max-model-len" not in flags
    args = build_parser().parse_args(["serve", "m", *flags])
    assert {name: getattr(args, name) for name in options} == options
    typed = engine_flags(dict(dtype=torch.bfloat16, device=torch.device("cpu")))
    assert typed == ["--dtype", "bfloat16", "--device", "cpu"]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (dict(model="m"), ValueError, "model"),
        (dict(overlap=False), ValueError, "overlap"),
        (dict(enable_overlap=1), TypeError, "enable_overlap"),
        (dict(max_num_seqs=True), TypeError, "max_num_seqs"),
    ],
)
def test_engine_flags_refuse_what_weft_serve_does_not_take(options, error, match):
    with pytest.raises(error, match=match):
        engine_flags(options)

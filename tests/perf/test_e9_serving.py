"""e9: `weft serve` under load over HTTP, timed on the client (`weft bench serve`'s conventions).

A latency-throughput curve per server: the same requests (prompt and output lengths uniform in a
range, token-id prompts, ignore_eos, greedy, streamed) at each request rate, Poisson arrivals in
seconds; TTFT, TPOT, ITL, E2E, throughput and goodput under the SLOs. The offline case serves the
same requests from the same engine options through the engine directly (what `LLM.generate` does):
at rate inf, the server's output tok/s over it is what HTTP costs.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.serve.servers import weft_server
from weft.benchmark import workloads
from weft.benchmark.environment import device_name, git_sha
from weft.benchmark.runner import RunConfig
from weft.benchmark.serving import run

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def e9_workload(sizes, model_for):
    vocab = model_for(sizes.model, sizes.dtype).config.vocab_size
    return workloads.standard(vocab, sizes.e9_requests, sizes.e9_lengths)


def server_args(config: RunConfig, workload: workloads.Workload, sizes, device) -> list[str]:
    """The engine options the offline case uses (WeftServer's), as `weft serve` flags."""
    P = config.block_size
    return [
        sizes.model, "--attention", config.attention, "--scheduler", config.scheduler, "--block-size", str(P),
        "--num-blocks", str(workload.blocks_needed(P)), "--max-num-seqs", str(len(workload)),
        "--max-num-batched-tokens", str(workload.input_tokens), "--max-model-len", str(workload.max_len),
        "--dtype", sizes.dtype, "--device", device.type, "--served-model-name", "e9",
    ]  # fmt: skip


def test_e9_offline(run_benchmark, sizes, e9_workload, e9_attention):
    run_benchmark("e9", RunConfig(attention=e9_attention), e9_workload, model=sizes.model, server="offline",
                  request_rate="inf")


@pytest.fixture(scope="module")
def e9_server(e9_attention, sizes, e9_workload, device):
    config = RunConfig(attention=e9_attention)
    if config.attention == "triton" and device.type != "cuda":
        pytest.skip("triton attention does not serve on cpu")
    with weft_server(*server_args(config, e9_workload, sizes, device)) as url:
        # a warm-up of the same shapes: compiles kernels, as the offline case's warm-up does
        short = e9_workload.with_max_tokens(2)
        asyncio.run(run(url, "e9", short.requests))
        yield config, url


def test_e9_serving(benchmark, sizes, e9_workload, e9_server, e9_rate, device):
    config, url = e9_server
    rate = e9_rate

    def serve() -> dict:
        return asyncio.run(run(url, "e9", e9_workload.requests, request_rate=rate, goodput=sizes.e9_goodput_ms))

    result = benchmark.pedantic(serve, rounds=1, iterations=1, warmup_rounds=0)
    assert result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == e9_workload.output_tokens
    benchmark.extra_info.update({
        "experiment": "e9", "config": config.label, "engine": "weft", "server": "weft serve",
        "scheduler": config.scheduler, "attention": config.attention, "block_size": config.block_size,
        "model": sizes.model, "dtype": sizes.dtype, "gpu": device_name(device), "git_sha": git_sha(),
        "workload": e9_workload.name, "requests": len(e9_workload),
        "output_tok_s": result["output_throughput"], "makespan_s": result["duration_s"],
        **{k: v for k, v in result.items() if k not in ("request_rate", "errors")},
        "request_rate": rate if math.isfinite(rate) else "inf",
    })  # fmt: skip

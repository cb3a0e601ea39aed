"""e9: serving over HTTP, timed on the client (`weft bench serve`'s conventions), weft beside HF's server.

- The curve: the same requests (prompt and output lengths uniform in a range, greedy, streamed,
  every one to its max_tokens) at each request rate, Poisson arrivals in seconds, against
  `weft serve` and against `transformers serve` (HF's continuous batching) on the very same
  weights; TTFT, TPOT, ITL, E2E, throughput and goodput under the SLOs.
- What HTTP costs: the standard workload at rate inf through `weft serve`, and the same engine
  options serving it offline (through the engine directly, as LLM.generate does).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.serve.servers import child_env, free_port, live, weft_server
from weft.benchmark import peer, workloads
from weft.benchmark.environment import device_name, git_sha
from weft.benchmark.runner import BenchConfig, engine_options, warmup
from weft.benchmark.serving import run
from weft.cli import engine_flags

pytestmark = pytest.mark.perf


@pytest.fixture(scope="module")
def vocab(sizes, model_for) -> int:
    return model_for(sizes.model, sizes.dtype).config.vocab_size


@pytest.fixture(scope="module")
def e9_curve(sizes, vocab) -> workloads.Workload:
    return workloads.uniform(sizes.e9_requests, sizes.e9_lengths, sizes.e9_lengths, vocab, seed=0, name="e9")


@pytest.fixture(scope="module")
def e9_standard(sizes, vocab) -> workloads.Workload:
    return workloads.standard(vocab, sizes.e8_requests, sizes.e8_lengths)


def serve(url: str, model: str, workload: workloads.Workload, rate: float, sizes, prompt_format: str) -> dict:
    result = asyncio.run(run(url, model, workload.requests, request_rate=rate, goodput=sizes.e9_goodput_ms,
                             prompt_format=prompt_format))
    assert result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == workload.output_tokens
    return result


def record(
    benchmark, keep_so_far, result: dict, workload: workloads.Workload, sizes, device, **identity: object
) -> None:
    rate = result["request_rate"]
    benchmark.extra_info.update({
        "experiment": "e9", **identity, "model": sizes.model, "dtype": sizes.dtype, "gpu": device_name(device),
        "git_sha": git_sha(), "workload": workload.name, "requests": len(workload),
        "output_tok_s": result["output_throughput"], "makespan_s": result["duration_s"],
        **{k: v for k, v in result.items() if k != "errors"}, "request_rate": rate,
    })  # fmt: skip
    keep_so_far()  # a curve is long: keep each rate's figures even if the session is cut short


# ---- weft ---------------------------------------------------------------------------------------------


def weft_identity(config: BenchConfig) -> dict[str, object]:
    return {"config": config.label, "engine": "weft", "scheduler": config.setting("scheduler"),
            "attention": config.setting("attention"), "block_size": config.setting("block_size")}


@pytest.fixture(scope="module")
def e9_config(e9_attention) -> BenchConfig:
    """weft's configuration, offline and over HTTP alike."""
    return BenchConfig(options=dict(attention=e9_attention))


def test_e9_offline(run_benchmark, sizes, e9_standard, e9_config):
    run_benchmark("e9", e9_config, e9_standard, model=sizes.model, server="offline", request_rate="inf")


@pytest.fixture(scope="module")
def e9_server(e9_config, sizes, e9_standard, e9_curve, device):
    """`weft serve` with the offline case's engine options (`engine_options` for the standard workload,
    whose pool also holds the curve's requests; its context, the curve's longest request too)."""
    if e9_config.setting("attention") == "triton" and device.type != "cuda":
        pytest.skip("triton attention does not serve on cpu")
    w = e9_standard
    options = engine_options(e9_config, w) | dict(max_model_len=max(w.max_len, e9_curve.max_len))
    flags = [*engine_flags(options), "--dtype", sizes.dtype, "--device", device.type, "--served-model-name", "e9"]
    with weft_server(sizes.model, *flags) as url:
        asyncio.run(run(url, "e9", warmup(e9_config, w).requests))  # offline's warm-up (not the curve's: its span)
        yield e9_config, url


def test_e9_standard_at_rate_inf(benchmark, keep_so_far, sizes, e9_standard, e9_server, device):
    config, url = e9_server
    result = benchmark.pedantic(serve, args=(url, "e9", e9_standard, math.inf, sizes, "token_ids"), rounds=1)
    record(benchmark, keep_so_far, result, e9_standard, sizes, device, server="weft serve", **weft_identity(config))


def test_e9_weft_curve(benchmark, keep_so_far, sizes, e9_curve, e9_server, e9_rate, device):
    config, url = e9_server
    result = benchmark.pedantic(serve, args=(url, "e9", e9_curve, e9_rate, sizes, "token_ids"), rounds=1)
    record(benchmark, keep_so_far, result, e9_curve, sizes, device, server="weft serve", **weft_identity(config))


# ---- the peer -----------------------------------------------------------------------------------------

PEER = BenchConfig(engine="hf_generate_batch")  # what `transformers serve` batches with


@pytest.fixture(scope="module")
def e9_peer(tmp_path_factory, sizes, e9_curve, device):
    """`transformers serve` on the model's weights (weft.benchmark.peer), warmed up as HF's dynamic peers are
    (`warmup`: a few tokens a request; its timed runs take minutes)."""
    from weft.inference.config import DTYPES

    checkpoint = peer.write_checkpoint(sizes.model, DTYPES[sizes.dtype], tmp_path_factory.mktemp("peer"))
    port = free_port()
    proc = peer.start_server(checkpoint, port, device.type, sizes.dtype, sizes.hf_cb_config, env=child_env())
    with live(proc, port) as url:
        asyncio.run(run(url, str(checkpoint), warmup(PEER, e9_curve).requests, prompt_format="words"))
        yield str(checkpoint), url


def test_e9_peer_curve(benchmark, keep_so_far, sizes, e9_curve, e9_peer, e9_rate, device):
    model, url = e9_peer
    result = benchmark.pedantic(serve, args=(url, model, e9_curve, e9_rate, sizes, "words"), rounds=1)
    record(benchmark, keep_so_far, result, e9_curve, sizes, device, server="transformers serve", config="hf_serve",
           engine="hf_serve", scheduler="continuous", attention="hf")

"""The perf suite's sizes, models, storage and the `run_benchmark` fixture every experiment uses.

Sizes live here and only here: with CUDA, the published matrix (Qwen3 shapes with random
weights, bf16); without it, toy sizes on a tiny random Llama, so the suite cannot rot.
CPU numbers are never published: they land in results/cpu/, not results/.

    uv run pytest tests/perf -m perf                   # CPU: toy sizes, results/cpu/
    WEFT_GIT_SHA=<sha> PYTHONPATH=. python3 -m pytest tests/perf -m perf   # GPU: results/
    uv run python -m weft.report                       # charts + results/README.md

Runs are not parallelized: pytest-benchmark disables itself under xdist (`-n`), and timings
taken next to other workers would be meaningless anyway, so perf tests skip there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from weft.attention import available_backends
from weft.benchmark.floor import floor_s, traffic_bytes
from weft.benchmark.metrics import Served
from weft.benchmark.profiling import top_ops
from weft.benchmark.runner import BenchConfig, Driver, make_driver, record, release, unrelated_bytes, warmup
from weft.benchmark.saving import save_so_far
from weft.benchmark.workloads import Workload
from weft.inference.config import DTYPES
from weft.models.loader import DEFAULT_MODEL, reference_model, resolve_model
from weft.utils import frozen_heap

HAS_CUDA = torch.cuda.is_available()

TINY = "tiny-llama"


@dataclass(frozen=True)
class Sizes:
    dtype: str
    model: str  # e4-e8
    large_model: str  # e1, e2
    attention: str  # the backend of the single-backend experiments (e5)
    e1_prompt_lens: tuple[int, ...]
    e1_batch: int
    e1_new_tokens: int
    e2_batches: tuple[int, ...]
    e2_prompt_len: int
    e2_new_tokens: int
    e4_requests: int
    e4_prompt_lens: tuple[int, ...]  # the mix each prompt's length is drawn from
    e4_new_tokens: int
    e4_rate: float  # Poisson arrivals, requests per engine tick (the seed's e4)
    e4_rate_per_s: float  # the same stream in wall-clock seconds
    e4_budget: int  # the step token budget of e4's chunked row: prompts prefilled in chunks beside the decodes
    e5_fractions: tuple[float, ...]
    e5_requests: int
    e5_prompt_range: tuple[int, int]
    e5_new_tokens: int
    e6_block_sizes: tuple[int, ...]
    e6_requests: int
    e6_prompt_range: tuple[int, int]
    e6_new_tokens: int
    e7_requests: int
    e7_prompt_len: int
    e7_new_tokens: int
    e8_requests: int  # the standard workload: 256 requests, lengths U[100, 1024]
    e8_lengths: tuple[int, int]
    e9_attentions: tuple[str, ...]  # continuous-scheduler weft servers whose latency-throughput curve is drawn
    e9_requests: int  # the curve's requests (its rate-inf check of what HTTP costs serves e8's workload)
    e9_lengths: tuple[int, int]  # the curve's prompt and output lengths, each uniform in this range
    e9_rates: tuple[float, ...]  # requests per second (inf: all at once), for weft and the peer alike
    e9_goodput_ms: dict[str, float]  # SLOs of the goodput: ttft, tpot
    e11_groups: int  # shared system prompts
    e11_per_group: int  # questions after each
    e11_system_len: int
    e11_question_len: int
    e11_new_tokens: int
    e11_budget: int  # max_num_batched_tokens: the engine's default, so a group's first prompts go in first
    hf_batch_size: int | None  # hf_generate's padded batch on e8 (None: all requests in one)
    hf_cb_config: dict | None  # ContinuousBatchingConfig fields for hf_generate_batch (None: its defaults)
    e12_prompt_len: int  # the ablation's batch-1 request (its other workload is e8's)
    e12_new_tokens: int
    e14_structured_model: str  # e14's grammar-constrained requests (with a tokenizer: see test_e14_sampling)
    e14_long_prompts: tuple[int, int]  # e14's n on long prompts: each prompt's tokens, and each output's
    e13_batch: int  # the profiled decode step's requests
    e13_context: int  # their prompts' tokens
    e13_prefill: int  # the prompt a mixed step prefills beside them
    e15_moe_model: str  # e15's mixture of experts: its batch sweep (e2's workload), batch-1 ITL and kernels
    e15_batches: tuple[int, ...]
    e15_dense_models: tuple[str, ...]  # the families whose batch-1 ITL (e12's request) is compared
    e15_kernel_tokens: tuple[int, ...]  # tokens routed through one MoE layer's expert kernels, each count a case
    e15_e8_budget: int  # max_num_batched_tokens of the MoE on e8's workload
    e17_models: tuple[str, ...]  # the dense shapes whose decode GEMMs and batch-1 ITL e17 measures


CUDA_SIZES = Sizes(
    dtype="bfloat16",
    model="qwen3-0.6b",
    large_model="qwen3-4b",
    attention="triton",
    e1_prompt_lens=(128, 512, 2048),
    e1_batch=4,
    e1_new_tokens=128,
    e2_batches=(1, 4, 16, 64, 256),
    e2_prompt_len=128,
    e2_new_tokens=64,
    e4_requests=64,
    e4_prompt_lens=(128, 256, 512, 1024, 2048),
    e4_new_tokens=128,
    e4_rate=1.0,
    e4_rate_per_s=4.0,
    e4_budget=1024,
    e5_fractions=(1.0, 0.8, 0.6, 0.4, 0.2),
    e5_requests=64,
    e5_prompt_range=(128, 512),
    e5_new_tokens=128,
    e6_block_sizes=(8, 16, 32, 64, 128, 256),
    e6_requests=32,
    e6_prompt_range=(256, 1024),
    e6_new_tokens=64,
    e7_requests=16,
    e7_prompt_len=512,
    e7_new_tokens=32,
    e8_requests=256,
    e8_lengths=(100, 1024),
    e9_attentions=("triton",),
    # 24 requests of up to 512 tokens, so that the peer (HF's server) gets through every rate: on 64 of up to
    # 1,024 it did not within a call's time limit (results/HISTORY.md, d92039a; no log kept), on these it takes
    # about a minute a rate (results/logs/h200_e9_c72ef45.log)
    e9_requests=24,
    e9_lengths=(100, 512),
    e9_rates=(1.0, 2.0, 4.0, 8.0, 16.0, float("inf")),
    e9_goodput_ms={"ttft": 500.0, "tpot": 50.0},
    e11_groups=4,
    e11_per_group=32,
    e11_system_len=1800,  # 90% of each prompt is its group's system prompt
    e11_question_len=200,
    e11_new_tokens=64,
    e11_budget=8192,
    # One padded batch of 256 costs about as many steps as one of 64 (the longest output sets both).
    hf_batch_size=None,
    hf_cb_config=None,
    e12_prompt_len=256,
    e12_new_tokens=128,
    e14_structured_model="qwen3-0.6b",
    e14_long_prompts=(2000, 128),
    e13_batch=256,
    e13_context=576,
    e13_prefill=512,
    e15_moe_model="qwen3-30b-a3b",
    e15_batches=(1, 16, 64, 256),
    e15_dense_models=("llama-3.1-8b", "qwen3-8b"),
    e15_kernel_tokens=(1, 256),
    e15_e8_budget=16384,
    e17_models=("qwen3-0.6b", "qwen3-4b", "qwen3-8b"),
)
CPU_SIZES = Sizes(
    dtype="float32",
    model=TINY,
    large_model=TINY,
    attention="paged",
    e1_prompt_lens=(16, 64),
    e1_batch=4,
    e1_new_tokens=8,
    e2_batches=(1, 4, 16),
    e2_prompt_len=16,
    e2_new_tokens=8,
    e4_requests=16,
    e4_prompt_lens=(8, 16, 32, 64),
    e4_new_tokens=8,
    e4_rate=1.0,
    e4_rate_per_s=20.0,
    e4_budget=32,
    e5_fractions=CUDA_SIZES.e5_fractions,
    e5_requests=8,
    e5_prompt_range=(16, 48),
    e5_new_tokens=16,
    e6_block_sizes=CUDA_SIZES.e6_block_sizes,
    e6_requests=8,
    e6_prompt_range=(16, 48),
    e6_new_tokens=8,
    e7_requests=4,
    e7_prompt_len=16,
    e7_new_tokens=4,
    e8_requests=8,
    e8_lengths=(4, 32),
    e9_attentions=("paged",),
    e9_requests=8,
    e9_lengths=(4, 16),
    e9_rates=(20.0, float("inf")),
    e9_goodput_ms={"ttft": 5000.0, "tpot": 1000.0},
    e11_groups=2,
    e11_per_group=4,
    e11_system_len=36,
    e11_question_len=4,
    e11_new_tokens=4,
    e11_budget=48,
    hf_batch_size=None,
    hf_cb_config=dict(num_blocks=16, max_batch_tokens=256),  # its defaults take the RAM
    e12_prompt_len=16,
    e12_new_tokens=16,
    e14_structured_model=DEFAULT_MODEL,  # the tiny models' vocabularies are narrower than any tokenizer's
    e14_long_prompts=(40, 4),
    e13_batch=8,
    e13_context=16,
    e13_prefill=8,
    e15_moe_model="tiny-qwen3-moe",
    e15_batches=(1, 4, 16),  # e2's
    e15_dense_models=("tiny-llama3", "tiny-qwen3"),
    e15_kernel_tokens=(1, 16),
    e15_e8_budget=64,
    e17_models=("tiny-qwen3",),
)
SIZES = CUDA_SIZES if HAS_CUDA else CPU_SIZES


def build_model(name: str, dtype: str, device: torch.device, logit_gain: float) -> PreTrainedModel:
    """A random-weight HF model of one of weft's named shapes (`tiny-llama` here on the CPU).

    `logit_gain` scales the final norm, hence the logits: a peakier model has no near-ties
    for greedy decoding to flip on when the same math is summed in another order.
    """
    model = reference_model(resolve_model(name), DTYPES[dtype], device)
    with torch.no_grad():
        model.model.norm.weight.mul_(logit_gain)
    return model


# ---- storage, xdist and progress -------------------------------------------------------------


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    skip = pytest.mark.skip(reason="perf benchmarks do not run under xdist (-n): run them in one process")
    for item in items:
        if "perf" in item.keywords:
            item.add_marker(skip)


def _progress(config: pytest.Config, line: str) -> None:
    """One line per finished benchmark, printed as it happens (runs are long)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if terminal is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        terminal.ensure_newline()
        terminal.write_line(line)


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sizes() -> Sizes:
    return SIZES


@pytest.fixture(params=SIZES.e17_models)
def e17_model(request: pytest.FixtureRequest) -> str:
    return request.param


# model-major, so that each model is built once for both engines
@pytest.fixture(params=[(m, e) for m in SIZES.e17_models for e in ("weft", "hf_generate_static")],
                ids=lambda p: "-".join(p))
def e17_itl_run(request: pytest.FixtureRequest) -> tuple[str, str]:
    return request.param


@pytest.fixture(scope="session")
def model_for(device: torch.device) -> Callable[..., PreTrainedModel]:
    """get(name, dtype, logit_gain=1.0, alone=False): models are built once per session and shared; `alone`
    drops every other one first (and gives its memory back), for a model too large to sit beside others."""
    cache: dict[tuple[str, str, float], PreTrainedModel] = {}

    def get(name: str, dtype: str, logit_gain: float = 1.0, alone: bool = False) -> PreTrainedModel:
        key = (name, dtype, logit_gain)
        if alone and (others := cache.keys() - {key}):
            for other in others:
                del cache[other]
            release(device)
        if key not in cache:
            cache[key] = build_model(name, dtype, device, logit_gain)
        return cache[key]

    return get


@pytest.fixture(params=SIZES.e1_prompt_lens, ids=lambda s: f"S{s}")
def e1_prompt_len(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(params=SIZES.e2_batches, ids=lambda b: f"B{b}")
def e2_batch(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(params=SIZES.e5_fractions, ids=lambda f: f"pool{f:g}")
def e5_fraction(request: pytest.FixtureRequest) -> float:
    return request.param


@pytest.fixture(params=SIZES.e6_block_sizes, ids=lambda p: f"P{p}")
def e6_block_size(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module", params=SIZES.e9_attentions)
def e9_attention(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=SIZES.e9_rates, ids=lambda r: f"rate{r:g}")
def e9_rate(request: pytest.FixtureRequest) -> float:
    return request.param


@pytest.fixture(params=SIZES.e15_batches, ids=lambda b: f"B{b}")
def e15_batch(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(params=SIZES.e15_kernel_tokens, ids=lambda t: f"T{t}")
def e15_kernel_tokens(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(params=(SIZES.e15_moe_model, *SIZES.e15_dense_models))  # the MoE first: it is built already
def e15_itl_model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def keep_so_far(request: pytest.FixtureRequest) -> Callable[[], None]:
    """save_so_far, for a test that times its runs itself (e9's over HTTP)."""
    return lambda: save_so_far(request.config)


@pytest.fixture
def run_benchmark(benchmark, request: pytest.FixtureRequest, device: torch.device, model_for) -> Callable[..., Served]:
    """run(experiment, config, workload, *, model, dtype, logit_gain, profile, **extra) -> the timed run.

    Builds the driver, serves a warm-up of the same prompts (`weft.benchmark.runner.warmup`), then
    times one full run (one round: a serving run is long) and records it in `benchmark.extra_info`.
    """

    def run(
        experiment: str,
        config: BenchConfig,
        workload: Workload,
        *,
        model: str,
        dtype: str = SIZES.dtype,
        logit_gain: float = 1.0,
        profile: bool = False,
        **extra: object,
    ) -> Served:
        attention = config.setting("attention")
        if config.engine == "weft" and attention not in available_backends(device):
            pytest.skip(f"{attention} attention does not serve on {device.type}")
        cb_config = ContinuousBatchingConfig(**SIZES.hf_cb_config) if SIZES.hf_cb_config else None
        hf = model_for(model, dtype, logit_gain)
        traffic = traffic_bytes(workload, hf)
        floor = floor_s(traffic, device)  # before the driver takes memory: the copy bandwidth is measured once, now
        other_bytes = unrelated_bytes(config, hf, device)
        driver = make_driver(config, hf, workload, dtype, device, cb_config)

        def timed(driver: Driver) -> tuple[Served, list[dict] | None]:
            if profile:
                return top_ops(lambda: driver.serve(workload), device, ticks=lambda s: s.steps or 1)
            return driver.serve(workload), None

        try:
            driver.serve(warmup(config, workload))
            with frozen_heap():  # weft's engine froze the heap it was built on; a peer's timed run gets the same
                served, ops = benchmark.pedantic(timed, args=(driver,), rounds=1, iterations=1, warmup_rounds=0)
            if ops is not None:
                extra = {**extra, "profiled": True, "top_ops": ops}
            info = record(experiment, config, driver, served, workload, model, dtype, device, other_bytes,
                          traffic_bytes=traffic, floor_s=floor)
        finally:
            driver.close()
            del driver
            release(device)
        benchmark.extra_info.update(info | extra)
        _progress(
            request.config,
            f"  {experiment} {config.label}: makespan {info['makespan_s']:.2f} s, "
            f"{info['output_tok_s']:.0f} out tok/s, TTFT p50 {info['ttft_p50_s'] or float('nan'):.3f} s",
        )
        save_so_far(request.config)  # a serving run is long: keep it even if the session is cut short
        assert info["incomplete_requests"] == 0, (
            f"{experiment} {config.label}: {info['incomplete_requests']} of {info['requests']} requests got fewer "
            "tokens than asked for"
        )
        return served

    return run

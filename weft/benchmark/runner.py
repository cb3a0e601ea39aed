"""Run one configuration on one workload and turn the result into a benchmark record.

A `BenchConfig` is a label's worth of settings: an engine (weft or an HF peer) and, for weft, EngineConfig
overrides. A `Driver` is built once per configuration (so its warm-up and its timed run share weights,
pool and compiled kernels), serves workloads, and describes itself for the record.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from weft.benchmark.environment import device_name, git_sha
from weft.benchmark.hf_baselines import HFContinuousBatching, HFGenerate
from weft.benchmark.metrics import Served, measure
from weft.benchmark.replay import Arrival, replay_seconds, replay_ticks
from weft.benchmark.workloads import Workload
from weft.inference.config import CHUNKED_BUDGET, EngineConfig, check_names
from weft.inference.engine import LLMEngine
from weft.inference.params import SamplingParams
from weft.inference.structured import StructuredOutputsParams

ENGINES = ("weft", "hf_generate", "hf_generate_static", "hf_generate_batch")
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# what the benchmark sets itself: the model, dtype and device from the session, the pool and context from the workload
SET_BY_BENCHMARK = ("model", "dtype", "device", "num_blocks", "max_model_len")

GRAPHS_OFF = {"NONE": "CUDA graphs", "FULL_DECODE_ONLY": "piecewise graphs", "PIECEWISE": "decode graphs"}
# weft's sampling besides greedy, as SamplingParams overrides (every run ignores EOS and runs to max_tokens)
SAMPLINGS: dict[str, dict[str, object]] = {
    "greedy": {},
    "sampled": dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                    repetition_penalty=1.1, seed=0),
    "n1": dict(temperature=0.8, seed=0),
    "n4": dict(n=4, temperature=0.8, seed=0),  # n1's requests, four completions each
    # greedy, through a grammar: a JSON object of a few fields whose last, a string without a bound, runs to
    # max_tokens unless the model closes it (then the grammar is complete and the request stops)
    "json": dict(structured_outputs=StructuredOutputsParams(json={
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                       "student": {"type": "boolean"}, "notes": {"type": "string"}},
        "required": ["name", "age", "student", "notes"],
    })),
}


@dataclass(frozen=True)
class BenchConfig:
    """What to serve with: an engine of ENGINES, and for weft EngineConfig overrides by field name (`options`;
    the rest keep EngineConfig's defaults) and the pool's size."""

    engine: str = "weft"
    options: dict[str, object] = field(default_factory=dict)
    pool_fraction: float = 1.0  # weft: the pool as a fraction of what holds every request at once
    hf_batch_size: int | None = None  # hf_generate(_static): requests per padded batch; None: all in one
    sampling: str = "greedy"  # weft: how every request samples, a name of SAMPLINGS

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: choose from {', '.join(ENGINES)}")
        object.__setattr__(self, "options", dict(self.options))  # a copy: the caller may reuse its dict
        if self.options and self.engine != "weft":
            raise ValueError(f"{self.engine} takes no engine options, got {', '.join(map(str, self.options))}")
        unknown = [name for name in self.options if name not in ENGINE_DEFAULTS]
        if unknown:
            raise ValueError(f"not EngineConfig fields: {', '.join(map(str, unknown))}")
        fixed = [name for name in self.options if name in SET_BY_BENCHMARK]
        if fixed:
            raise ValueError(f"{', '.join(fixed)}: set by the benchmark from the session and the workload, not options")
        if self.engine == "weft":
            check_names(self.setting("attention"), self.setting("scheduler"), self.setting("cudagraph_mode"))
        if not 0 < self.pool_fraction <= 1:
            raise ValueError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")
        if self.sampling not in SAMPLINGS or (self.sampling != "greedy" and self.engine != "weft"):
            raise ValueError(f"sampling {self.sampling!r}: weft's are {', '.join(SAMPLINGS)}; the baselines are greedy")

    def params(self, max_tokens: int) -> SamplingParams:
        """What a request of `max_tokens` samples with."""
        settings = {"temperature": 0.0, **SAMPLINGS[self.sampling]}  # greedy unless the sampling says otherwise
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **settings)

    def setting(self, name: str) -> object:
        """weft's EngineConfig `name`: the option given, else EngineConfig's default."""
        return self.options.get(name, ENGINE_DEFAULTS[name])

    @property
    def label(self) -> str:
        """'continuous×triton' for weft (', no prefix cache' and the like for what the options turn off, ', budget
        1024' for a step token budget other than the engine's default), the engine name for the HF baselines."""
        if self.engine != "weft":
            return self.engine
        graphs = GRAPHS_OFF.get("NONE" if self.options.get("enforce_eager") else self.setting("cudagraph_mode"))

        def off(option: str) -> bool:
            return self.options.get(option) is False  # only when asked: the defaults go unlabelled

        parts = (("chunked prefill", off("enable_chunked_prefill")), (graphs, graphs is not None),
                 ("prefix cache", off("enable_prefix_caching")), ("overlap", off("enable_overlap")),
                 ("fused layers", off("enable_fused_layers")), ("tuned GEMMs", off("enable_tuned_gemms")))
        budget = self.options.get("max_num_batched_tokens", CHUNKED_BUDGET)
        budgeted = "" if budget == CHUNKED_BUDGET else f", budget {budget}"
        sampled = ", deterministic" if self.options.get("deterministic") else ""
        sampled += "" if self.sampling == "greedy" else f", {self.sampling}"
        return f"{self.setting('scheduler')}×{self.setting('attention')}" + "".join(
            f", no {name}" for name, is_off in parts if is_off) + budgeted + sampled

    @property
    def id(self) -> str:
        """The label as a pytest id (ASCII)."""
        return (self.label.replace("×", "-").replace(", no prefix cache", "-nocache")
                .replace(", no chunked prefill", "-nochunks").replace(", no CUDA graphs", "-eager")
                .replace(", no piecewise graphs", "-nopiecewise").replace(", no decode graphs", "-nodecodegraphs")
                .replace(", no overlap", "-nooverlap").replace(", no fused layers", "-nofused")
                .replace(", no tuned GEMMs", "-notuned")
                .replace(", budget ", "-budget").replace(", ", "-"))


class Driver(Protocol):
    """Drives one engine through a benchmark's workloads."""

    def serve(self, workload: Workload) -> Served: ...

    def describe(self) -> dict[str, object]:
        """engine, scheduler, attention, pool_blocks, block_size and engine-specific settings."""
        ...

    def close(self) -> None:
        """Free what the driver holds (pool, cache, threads)."""
        ...


def engine_options(config: BenchConfig, workload: Workload) -> dict[str, object]:
    """EngineConfig's keyword arguments but model, dtype and device for weft's `config` on `workload`.

    The engine is sized to the workload: at pool_fraction 1 its pool holds every request at once, each of its n
    completions whole (the contiguous backend: a row per completion it may hold), and by default it may hold
    them all in a step, with all their prompts' tokens; then `config.options` on top (an option given wins).
    """
    if config.engine != "weft":
        raise ValueError(f"engine options are weft's, not {config.engine}'s")
    n = SAMPLINGS[config.sampling].get("n", 1)
    max_num_seqs = config.options.get("max_num_seqs", len(workload) * n)
    if config.setting("attention") == "contiguous":
        num_blocks = max_num_seqs  # rows of S_max = max_model_len slots
    else:
        P = config.setting("block_size")
        shrunk = math.ceil(workload.blocks_needed(P) * n * config.pool_fraction)  # n unshared: a bound
        num_blocks = max(shrunk, workload.largest_request_blocks(P))
    # By default the token budget never limits admission: batches are bounded by max_num_seqs and the pool,
    # so the static scheduler forms the batches it is meant to.
    sized = dict(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=workload.input_tokens,
                 max_model_len=workload.max_len)
    return sized | config.options


class WeftDriver:
    """A persistent weft engine sized for `workload` (`engine_options`). Each `serve` replays a workload's
    arrivals (ticks or seconds) into it."""

    def __init__(
        self, model: PreTrainedModel, config: BenchConfig, workload: Workload, dtype: str, device: torch.device
    ) -> None:
        self.config = config
        self.engine_config = EngineConfig(model=model, dtype=dtype, device=device, **engine_options(config, workload))
        self.engine = LLMEngine(self.engine_config)
        self.runs = 0

    def serve(self, workload: Workload) -> Served:
        self.runs += 1
        seconds = workload.clock == "seconds"
        arrivals = [
            Arrival(f"run{self.runs}-{i}", list(r.prompt_token_ids), self.config.params(r.max_tokens),
                    r.arrival_s if seconds else r.arrival_tick)
            for i, r in enumerate(workload.requests)
        ]
        before = dataclasses.replace(self.engine.stats)
        with measure(self.engine_config.device) as window:
            outputs = (replay_seconds if seconds else replay_ticks)(self.engine, arrivals)
        stats = self.engine.stats.since(before)
        return Served(outputs, window, stats.num_preemptions, stats.recomputed_tokens, stats.steps,
                      stats.prefix_cache_hit_rate)

    def describe(self) -> dict[str, object]:
        c, pool = self.engine.config, self.engine.pool
        return {
            "engine": "weft",
            "scheduler": c.scheduler,
            "attention": c.attention,
            "pool_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "pool_fraction": self.config.pool_fraction,
            "sampling": self.config.sampling,
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "decode_graphs": self.engine.runner.graphs is not None,  # what ran: a backend may have none to capture
            "mixed_graphs": self.engine.runner.mixed is not None,
            "piecewise_graphs": self.engine.runner.pieces is not None,
            "prefix_caching": c.enable_prefix_caching,
            "chunked_prefill": c.enable_chunked_prefill,
            "overlap": c.enable_overlap,
            "fused_layers": c.enable_fused_layers,
            "tuned_gemms": c.enable_fused_layers and c.enable_tuned_gemms,  # (they act with the fused layers)
            "deterministic": c.deterministic,
        }

    def close(self) -> None:
        self.engine.close()


def make_driver(
    config: BenchConfig,
    model: PreTrainedModel,
    workload: Workload,
    dtype: str,
    device: torch.device,
    hf_cb_config: ContinuousBatchingConfig | None = None,
) -> Driver:
    """`hf_cb_config` sizes hf_generate_batch's cache (None: transformers' defaults)."""
    if config.engine == "weft":
        return WeftDriver(model, config, workload, dtype, device)
    if config.engine in ("hf_generate", "hf_generate_static"):
        return HFGenerate(model, config.hf_batch_size, device, static=config.engine == "hf_generate_static")
    return HFContinuousBatching(model, workload, device, hf_cb_config)


WARMUP_TOKENS = 2  # a warm-up request's new tokens where a short warm-up serves: HF's dynamic peers (`warmup`)


def warmup(config: BenchConfig, workload: Workload) -> Workload:
    """What a driver serves before `workload` is timed: its prompts (`Workload.warmup`: the ids moved), whole. A
    warm-up of a few tokens a request builds other batches than the timed run's (its requests leave before the
    prompts are all in; on a ticks stream each is held two steps, never beside the timed run's 60-odd decodes),
    and what those batches first meet would be met while timed (e11's cached burst on H100s: TTFT p50 122-131 ms
    in five runs warmed with two tokens a request, 87 ms in two warmed whole:
    results/logs/h100_e11_warmup_8740c3a.log). HF's static cache is sized to a batch's prompts and max_new_tokens,
    and generate compiles its forward for that size. A whole warm-up costs what the timed run costs (a stream in
    seconds: its arrivals' span again). HF's dynamic peers (generate and generate_batch) alone warm up on
    WARMUP_TOKENS a request, but for a ticks stream: their timed runs take minutes, and what a first step meets is
    lost in them."""
    ticks_stream = workload.clock == "ticks" and not workload.offline
    short = config.engine in ("hf_generate", "hf_generate_batch") and not ticks_stream
    return workload.warmup(WARMUP_TOKENS if short else max(r.max_tokens for r in workload.requests))


def release(device: torch.device) -> None:
    """Give the finished driver's memory back before the next configuration allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def unrelated_bytes(config: BenchConfig, model: PreTrainedModel, device: torch.device) -> int:
    """Device memory held now that a run of `config` on `model` must not be charged for.

    Taken before the driver is built. The HF baselines serve from `model` itself, so its
    weights are theirs; weft copies them into its own model, allocated after this point,
    so everything held now (the session's models) is someone else's.
    """
    if device.type != "cuda":
        return 0
    held = torch.cuda.memory_allocated(device)
    if config.engine == "weft":
        return held
    return held - sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def record(
    experiment: str,
    config: BenchConfig,
    driver: Driver,
    served: Served,
    workload: Workload,
    model: str,
    dtype: str,
    device: torch.device,
    other_bytes: int = 0,
    traffic_bytes: int | None = None,
    floor_s: float | None = None,
) -> dict[str, object]:
    """Everything `benchmark.extra_info` holds about one run (callers add experiment-specific keys).

    The peak memory is charged to the run alone (its weights, pool or cache, activations):
    `other_bytes`, what the process held for other things (see `unrelated_bytes`), comes off.
    `traffic_bytes` and `floor_s`: the workload's memory traffic and its time at the copy bandwidth (floor.py).
    """
    metrics = served.metrics().as_record()
    if metrics["peak_mem_bytes"] is not None:
        metrics["peak_mem_bytes"] -= other_bytes
    return {
        "experiment": experiment,
        "config": config.label,
        **driver.describe(),
        "model": model,
        "dtype": dtype,
        "gpu": device_name(device),
        "git_sha": git_sha(),
        "workload": workload.name,
        **metrics,
        "steps": served.steps,
        "traffic_bytes": traffic_bytes,
        "floor_s": floor_s,
        "prefix_cache_hit_rate": served.prefix_cache_hit_rate,
        # requests that got fewer tokens than asked for and did not stop on their own (every run ignores EOS, so
        # only a grammar, complete, stops one): a baseline that failed or stopped early
        "incomplete_requests": sum(
            any(len(c.token_ids) < r.max_tokens and c.finish_reason != "stop" for c in o.outputs)
            for o, r in zip(served.outputs, workload.requests, strict=True)
        ),
    }

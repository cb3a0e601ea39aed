"""The HuggingFace peers, served the same token ids as weft and reported in weft's terms.

- `HFGenerate`: `model.generate`, static batching: left-padded batches, each running until
  its longest request is done. A request gets its own first `max_tokens` tokens, timed as
  they streamed out; the padding work is the baseline's cost, not counted as output. With
  `static`, HF's fast path: `cache_implementation="static"`, whose forward `generate` compiles
  with torch.compile on a GPU (the warm-up run, of the same shapes, pays for the compilation).
- `HFContinuousBatching`: transformers' own continuous batching (the manager that
  `generate_batch` drives). `generate_batch` takes one `max_new_tokens` for all requests,
  so requests are added to the manager directly, each with its own. The manager lives as
  long as the driver: its start-up (cache allocation, CUDA-graph capture) and the warm-up
  run happen before the timed run, as weft's do.

Both ignore EOS, like weft's benchmark runs, and count the tokens each request received.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import torch
from transformers import PreTrainedModel
from transformers.generation import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from weft.benchmark.metrics import Served, measure
from weft.benchmark.workloads import Request, Workload
from weft.inference.outputs import CompletionOutput, RequestMetrics, RequestOutput

PAD_TOKEN_ID = 0  # masked out by the attention mask, so any id will do
RESULT_POLL_S = 1.0


def _require_offline(workload: Workload, engine: str) -> None:
    if not workload.offline:
        raise ValueError(f"{engine} serves offline workloads (all requests at tick 0), not {workload.name!r}")


def _output(
    i: int, request: Request, tokens: list[int], arrival: float, scheduled: float, times: list[float]
) -> RequestOutput:
    metrics = RequestMetrics(arrival, scheduled, times, times[-1] if times else None)
    completion = CompletionOutput(0, "", tokens, "length")
    return RequestOutput(i, None, list(request.prompt_token_ids), [completion], True, metrics)


class StepClock(BaseStreamer):
    """A `generate` streamer that records when each step's tokens reached the host.

    generate hands over `next_tokens.cpu()`, a synchronizing copy: the instant is after the device finished.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True  # the first call carries the prompt

    def end(self) -> None:
        pass  # the last step was timed by its put


class HFGenerate:
    def __init__(
        self, model: PreTrainedModel, batch_size: int | None, device: torch.device, static: bool = False
    ) -> None:
        self.model = model
        self.batch_size = batch_size  # None: the whole workload in one batch
        self.device = device
        self.static = static
        self.used_batch_size: int | None = None

    @property
    def name(self) -> str:
        return "hf_generate_static" if self.static else "hf_generate"

    def serve(self, workload: Workload) -> Served:
        _require_offline(workload, self.name)
        size = self.used_batch_size = self.batch_size or len(workload)
        outputs: list[RequestOutput] = []
        with measure(self.device) as window:
            for first in range(0, len(workload), size):
                outputs += self._batch(workload.requests[first : first + size], first, window.start)
        return Served(outputs, window, preemptions=0, recomputed_tokens=0)

    def _batch(self, requests: tuple[Request, ...], first: int, arrival: float) -> list[RequestOutput]:
        scheduled = time.perf_counter()
        width = max(len(r.prompt_token_ids) for r in requests)
        input_ids = torch.full((len(requests), width), PAD_TOKEN_ID, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, r in enumerate(requests):
            input_ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - len(r.prompt_token_ids) :] = 1
        config = GenerationConfig(
            max_new_tokens=max(r.max_tokens for r in requests),
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
            eos_token_id=[],  # no EOS: None would fall back to the model's own
            cache_implementation="static" if self.static else None,
        )
        clock = StepClock()
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=config,
            streamer=clock,
        )
        new = out[:, width:].tolist()
        return [
            _output(first + row, r, new[row][: r.max_tokens], arrival, scheduled, clock.times[: r.max_tokens])
            for row, r in enumerate(requests)
        ]

    def describe(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "scheduler": "static",
            "attention": self.model.config._attn_implementation,
            "pool_blocks": None,
            "block_size": None,
            "hf_batch_size": self.used_batch_size,
        }

    def close(self) -> None:
        pass  # nothing outlives a `generate` call


class HFContinuousBatching:
    def __init__(
        self,
        model: PreTrainedModel,
        workload: Workload,
        device: torch.device,
        cb_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.device = device
        # max_new_tokens only sizes the manager; each request brings its own
        config = GenerationConfig(max_new_tokens=max(r.max_tokens for r in workload.requests), do_sample=False)
        config.eos_token_id = -1  # no EOS; the manager would set it so itself, with a warning
        self.stack = ExitStack()
        self.manager = self.stack.enter_context(
            model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb_config, block=True
            )
        )
        self.attention = model.config._attn_implementation  # the manager may have switched it
        self.runs = 0

    def serve(self, workload: Workload) -> Served:
        _require_offline(workload, "hf_generate_batch")
        self.runs += 1
        ids = [f"run{self.runs}-{i}" for i in range(len(workload))]
        results = {}
        with measure(self.device) as window:
            for request_id, r in zip(ids, workload.requests, strict=True):
                self.manager.add_request(
                    list(r.prompt_token_ids), request_id=request_id, max_new_tokens=r.max_tokens,
                    record_timestamps=True,
                )
            while len(results) < len(ids):
                result = self.manager.get_result(timeout=RESULT_POLL_S)
                if result is None:
                    if not self.manager.is_running():
                        break  # its loop died: the missing requests count as producing nothing
                elif result.is_finished():
                    results[result.request_id] = result
        outputs = []
        for i, (request_id, r) in enumerate(zip(ids, workload.requests, strict=True)):
            result = results.get(request_id)
            tokens = list(result.generated_tokens)[: r.max_tokens] if result else []
            times = list(result.timestamps or [])[: len(tokens)] if result else []
            outputs.append(_output(i, r, tokens, window.start, window.start, times))
        return Served(outputs, window)

    def close(self) -> None:
        """Stops the manager, which frees its cache and gives the model its attention back."""
        self.stack.close()

    def describe(self) -> dict[str, object]:
        return {
            "engine": "hf_generate_batch",
            "scheduler": "continuous",
            "attention": self.attention,
            "pool_blocks": None,
            "block_size": None,
        }

"""LLMEngine: one model, one KV pool, one scheduler and runner, for as long as the engine lives.

vLLM's interface: `add_request` queues a request (every check runs here, before any work; `add_requests`
checks several before queueing any), `step` runs one forward pass over what the scheduler picks and returns
the outputs it produced, `abort_request` drops a request and frees its blocks at once. Everything the engine
holds is built in `__init__`: weights are read once, the pool is sized once, CUDA graphs are captured once.
The engine keeps no clock of its own: callers decide when requests arrive.

Who writes what: the scheduler (with the engine's block manager) owns each request's state from its queueing
to its end, updating it when a step is launched and when it lands; the engine builds the sequences, counts
its stats and turns landed requests into outputs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.block_manager import BlockManager
from weft.inference.config import EngineConfig
from weft.inference.detokenizer import IncrementalDetokenizer
from weft.inference.inputs import PROMPT, parse_prompt
from weft.inference.outputs import CompletionOutput, EngineSnapshot, EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import RequestOutputKind, check_sampling_params
from weft.inference.ranks import RankGroup, build_rank
from weft.inference.runner import Launched, ModelRunner
from weft.inference.scheduler import SCHEDULERS, ScheduledBatch
from weft.inference.sequence import Sequence
from weft.models.llama import LlamaForCausalLM
from weft.models.loader import resolve_model

logger = logging.getLogger(__name__)

RequestId = str | int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        source = resolve_model(config.model)
        self.config = config = config.for_model(source.config)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.eos_token_ids = source.eos_token_ids
        self.ranks = RankGroup.start(config)  # the other tensor-parallel ranks build theirs beside this one
        self.runner: ModelRunner | None
        self.runner, self.pool = build_rank(config, source, 0, self.ranks)
        logger.info("%s: %s", source.name, self.pool.describe(config))
        self.blocks = BlockManager(self.pool.num_blocks, self.pool.block_size, config.enable_prefix_caching)
        self.scheduler = SCHEDULERS[config.scheduler](
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            self.eos_token_ids,
        )
        self.requests: dict[RequestId, Sequence] = {}  # in flight: queued or running
        self.in_flight: deque[Launched] = deque()  # steps queued on the device, not landed yet (oldest first)
        self.stats = EngineStats()

    @property
    def model(self) -> LlamaForCausalLM | None:
        """The model this rank serves (its slice under tensor parallelism); None once closed."""
        return self.runner.model if self.runner is not None else None

    # ---- requests in --------------------------------------------------------------------------

    def add_request(
        self, request_id: RequestId, prompt: object, params: object = None, arrival_time: float | None = None,
        label: str | None = None,
    ) -> None:
        """Queue a request; ValueError (TypeError for a wrong type) before anything is queued, naming the field
        at fault (weft.errors).

        `prompt`: text, token ids or vLLM's dict forms (weft.inference.inputs); `params`: a
        SamplingParams (None: the defaults); `arrival_time`: its time.perf_counter instant (now);
        `label`: its name in errors (`request <id>`).
        """
        self.add_requests([request_id], [prompt], [params], arrival_time, None if label is None else [label])

    def add_requests(
        self, request_ids: Seq[RequestId], prompts: Seq[object], params: Seq[object], arrival_time: float | None = None,
        labels: Seq[str] | None = None,
    ) -> None:
        """Queue several requests, or none: every one is checked before any is queued (as `add_request`, with
        one prompt, SamplingParams (or None) and label per id)."""
        self._check_open()
        labels = labels if labels is not None else [f"request {rid!r}" for rid in request_ids]
        if not len(request_ids) == len(prompts) == len(params) == len(labels):
            raise ValueError(f"add_requests takes one prompt, SamplingParams and label per request id: got "
                             f"{len(request_ids)} ids, {len(prompts)} prompts, {len(params)} params, "
                             f"{len(labels)} labels")
        now = time.perf_counter() if arrival_time is None else arrival_time
        seqs = [self._sequence(*request, now) for request in zip(request_ids, prompts, params, labels, strict=True)]
        ids = [seq.request_id for seq in seqs]
        for i, rid in enumerate(ids):
            if rid in self.requests or rid in ids[:i]:
                raise ParamValueError(f"{labels[i]}: request id {rid!r} is already in flight")
        for seq in seqs:
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)

    def _sequence(self, request_id: RequestId, prompt: object, params: object, label: str, now: float) -> Sequence:
        """A checked request's state, queued nowhere yet."""
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            raise ParamTypeError(f"request_id must be a str or an int, got {request_id!r}")
        params = check_sampling_params(params, label)
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.V, label)
        ids, cfg = parsed.token_ids, self.config
        if len(ids) >= cfg.max_model_len:
            raise ParamValueError(
                f"{label} has {len(ids)} tokens; the model's context (max_model_len) is {cfg.max_model_len}, "
                "which must leave room for at least one new token", PROMPT,
            )
        if not cfg.enable_chunked_prefill and len(ids) > cfg.max_num_batched_tokens:
            raise ParamValueError(
                f"{label} has {len(ids)} tokens, more than max_num_batched_tokens={cfg.max_num_batched_tokens} "
                "(with enable_chunked_prefill=False a prompt is prefilled in one step)", PROMPT,
            )
        max_tokens = params.max_tokens or cfg.max_model_len
        seq = Sequence(
            request_id=request_id,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            params=params,
            max_len=min(len(ids) + max_tokens, cfg.max_model_len),
            metrics=RequestMetrics(now),
            prompt=parsed.text,
        )
        need = self.blocks.blocks_for(seq.max_kv_tokens)
        if need > self.blocks.num_blocks:
            raise ParamValueError(
                f"{label} needs {seq.max_kv_tokens} cache slots ({need} blocks of {self.blocks.block_size}); "
                f"the pool has {self.blocks.num_blocks} blocks, so it could never run", PROMPT,
            )
        if self.tokenizer is not None and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # nothing predicts the first token
        return seq

    def abort_request(self, request_id: RequestId | Iterable[RequestId]) -> None:
        """Drop requests (unknown or finished ids are ignored, as in vLLM); their blocks are free at once."""
        ids = [request_id] if isinstance(request_id, str | int) else list(request_id)
        for rid in ids:
            seq = self.requests.pop(rid, None)
            if seq is not None:
                self.scheduler.remove(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges now and a copy of its counters: one reading, for the server's /metrics."""
        return EngineSnapshot(len(self.scheduler.running), len(self.scheduler.waiting),
                              self.blocks.num_blocks - self.blocks.num_free, self.blocks.num_blocks,
                              dataclasses.replace(self.stats))

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over what the scheduler picks; -> an output per request that got a token
        (as its output_kind says: all so far, this step's, or only the final one).

        With enable_overlap the step is queued on the device and the one before it lands while it runs
        (its tokens, stop checks and outputs are the host's work hidden behind the device's): a step
        returns the outputs of the step before, and a request that stopped there runs one step more,
        whose token is dropped. A step asking for logprobs lands at once."""
        self._check_open()
        outputs = self._land(keep=1)  # what an interrupted call left in flight
        batch = self.scheduler.schedule()
        self._count(batch)
        if not batch:
            if not self.in_flight and self.scheduler.has_work() and not batch.preempted:
                raise RuntimeError("the scheduler made no progress: this is a weft bug, please report it")
            return outputs + self._land(keep=0)
        launched = self._launch(batch)
        overlap = self.config.enable_overlap and not launched.asks_logprobs
        return outputs + self._land(keep=1 if overlap else 0)

    def _count(self, batch: ScheduledBatch) -> None:
        """The step's work in the counters, before it changes any request."""
        s = self.stats
        s.num_preemptions += len(batch.preempted)
        s.recomputed_tokens += sum(lost for _, lost in batch.preempted)
        s.prefix_cache_queries += batch.admitted_tokens
        s.prefix_cache_hits += batch.cached_tokens
        if batch:
            s.steps += 1
        for seq, T in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if T == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:  # the newest token, sampled last step
                s.decode_tokens += T
            else:
                s.prefill_tokens += T

    def _launch(self, batch: ScheduledBatch) -> Launched:
        """Queue `batch` on the device (after the steps in flight, whose ids it may read there)."""
        start = time.perf_counter()
        launched = self.runner.launch(batch, self.in_flight[-1] if self.in_flight else None)
        self.scheduler.launched(batch, launched.sampled, start)
        self.in_flight.append(launched)
        return launched

    def _land(self, keep: int) -> list[RequestOutput]:
        """Land the steps in flight, oldest first, until `keep` are left -> their outputs. A step leaves the
        queue only once its ids have come back, so an interrupted wait can be taken up again."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        outputs = []
        while len(self.in_flight) > keep:
            step = self.in_flight[0].land(decode)
            self.in_flight.popleft()
            for seq in self.scheduler.landed(step):
                self.stats.generation_tokens += 1
                if len(seq.token_ids) == seq.num_prompt_tokens + 1:
                    self.stats.prompt_tokens += seq.num_prompt_tokens
                if seq.finish_reason is not None:
                    del self.requests[seq.request_id]
                output = self._output(seq)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput | None:
        kind, finished = seq.params.output_kind, seq.finish_reason is not None
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        returned, is_delta = seq.num_returned_tokens, kind is RequestOutputKind.DELTA
        ids = seq.token_ids[seq.num_prompt_tokens + (returned if is_delta else 0) :]  # a delta copies only its own
        if is_delta:
            seq.num_returned_tokens = returned + len(ids)
        logprobs = seq.logprobs
        if logprobs is not None:
            logprobs = logprobs[returned:] if is_delta else list(logprobs)
        prompt_logprobs = None if is_delta and returned else seq.prompt_logprobs
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add(seq.token_ids[-1:], final=finished)
            text = delta if is_delta else seq.detokenizer.text
        elif self.tokenizer is not None:  # FINAL_ONLY, finished: its text decoded as a stream's would be, at once
            text = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids).add(ids, final=True)
        else:
            text = ""
        completion = CompletionOutput(0, text, ids, seq.finish_reason, seq.stop_reason, logprobs)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished, seq.metrics,
                             list(prompt_logprobs) if prompt_logprobs is not None else None)

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the model, the pool and the CUDA graphs; the engine refuses work from here on."""
        if self.runner is None:
            return
        self.abort_request(list(self.requests))
        self.ranks.stop(self.runner)
        self.in_flight.clear()
        self.runner = None
        gc.collect()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.runner is None:
            raise RuntimeError("this engine is closed")

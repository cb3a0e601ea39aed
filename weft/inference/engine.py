"""LLMEngine: one model, one KV pool, one scheduler and runner, for as long as the engine lives.

vLLM's interface: `add_request` queues a request (every check runs here, before any work),
`step` runs one forward pass over what the scheduler picks and returns the outputs it
produced, `abort_request` drops a request and frees its blocks at once. Everything the engine
holds is built in `__init__`: weights are read once, the pool is sized once, CUDA graphs are
captured once. The engine keeps no clock of its own: callers decide when requests arrive.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Iterable

import torch

from weft.distributed import TensorParallel
from weft.inference.block_manager import BlockManager
from weft.inference.config import EngineConfig
from weft.inference.detokenizer import IncrementalDetokenizer
from weft.inference.inputs import parse_prompt
from weft.inference.logprobs import as_dict
from weft.inference.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import RequestOutputKind, check_sampling_params
from weft.inference.pool import plan_pool
from weft.inference.runner import Launched, ModelRunner, StepOutput
from weft.inference.scheduler import SCHEDULERS, ScheduledBatch
from weft.inference.sequence import Sequence, Status
from weft.inference.worker import (
    free_port,
    join_group,
    load_slice,
    make_runner,
    share_pool,
    start_workers,
    stop_workers,
)
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
        device, tp = config.device, TensorParallel(0, config.tensor_parallel_size)
        self.workers = []  # the other tensor-parallel ranks, loading their slices beside this one
        if tp.size > 1:
            port = free_port()
            self.workers = start_workers(config, port)
        self.model = load_slice(config, source, tp, device)
        # after the weights: on CUDA it sizes from what is left; each rank's pool holds its K/V heads
        self.pool = plan_pool(config, tp.local(source.config))
        if tp.size > 1:
            join_group(tp, port, device)
            share_pool(self.pool, device)
        logger.info("%s: %s", source.name, self.pool.describe(config))
        blocks = BlockManager(self.pool.num_blocks, self.pool.block_size, config.enable_prefix_caching)
        self.scheduler = SCHEDULERS[config.scheduler](
            blocks, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self.runner: ModelRunner | None = make_runner(config, source, self.model, self.pool, tp, device)
        self.requests: dict[RequestId, Sequence] = {}  # in flight: queued or running
        self.in_flight: deque[Launched] = deque()  # steps queued on the device, not landed yet (oldest first)
        self.stats = EngineStats()

    # ---- requests in --------------------------------------------------------------------------

    def add_request(
        self, request_id: RequestId, prompt: object, params: object = None, arrival_time: float | None = None
    ) -> None:
        """Queue a request; ValueError (TypeError for a wrong type) before anything is queued.

        `prompt`: text, token ids or vLLM's dict forms (weft.inference.inputs); `params`: a
        SamplingParams (None: the defaults); `arrival_time`: its time.perf_counter instant (now).
        """
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time))

    def make_request(
        self,
        request_id: RequestId,
        prompt: object,
        params: object = None,
        arrival_time: float | None = None,
        label: str | None = None,
    ) -> Sequence:
        """Check a request and build its state, queueing nothing; `label` names it in errors."""
        self._check_open()
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            raise TypeError(f"request_id must be a str or an int, got {request_id!r}")
        label = label or f"request {request_id!r}"
        if request_id in self.requests:
            raise ValueError(f"{label}: request id {request_id!r} is already in flight")
        params = check_sampling_params(params, label)
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.V, label)
        ids, cfg = parsed.token_ids, self.config
        if len(ids) >= cfg.max_model_len:
            raise ValueError(
                f"{label} has {len(ids)} tokens; the model's context (max_model_len) is {cfg.max_model_len}, "
                "which must leave room for at least one new token"
            )
        if not cfg.enable_chunked_prefill and len(ids) > cfg.max_num_batched_tokens:
            raise ValueError(
                f"{label} has {len(ids)} tokens, more than max_num_batched_tokens={cfg.max_num_batched_tokens} "
                "(with enable_chunked_prefill=False a prompt is prefilled in one step)"
            )
        max_tokens = params.max_tokens or cfg.max_model_len
        seq = Sequence(
            request_id=request_id,
            token_ids=list(ids),
            num_prompt_tokens=len(ids),
            params=params,
            max_len=min(len(ids) + max_tokens, cfg.max_model_len),
            metrics=RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
            prompt=parsed.text,
        )
        blocks = self.scheduler.blocks
        need = blocks.blocks_for(seq.max_kv_tokens)
        if need > blocks.num_blocks:
            raise ValueError(
                f"{label} needs {seq.max_kv_tokens} cache slots ({need} blocks of {blocks.block_size}); "
                f"the pool has {blocks.num_blocks} blocks, so it could never run"
            )
        if self.tokenizer is not None and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # nothing predicts the first token
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a request `make_request` built."""
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

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
        self.stats.num_preemptions += len(batch.preempted)
        self.stats.recomputed_tokens += sum(lost for _, lost in batch.preempted)
        self.stats.prefix_cache_queries += batch.admitted_tokens
        self.stats.prefix_cache_hits += batch.cached_tokens
        if not batch:
            if not self.in_flight and self.scheduler.has_work() and not batch.preempted:
                raise RuntimeError("the scheduler made no progress: this is a weft bug, please report it")
            return outputs + self._land(keep=0)
        self.in_flight.append(self._launch(batch))
        overlap = self.config.enable_overlap and not self.in_flight[-1].asks_logprobs
        return outputs + self._land(keep=1 if overlap else 0)

    def _launch(self, batch: ScheduledBatch) -> Launched:
        """Queue `batch` on the device; its tokens count as computed, its sampled ones as pending, and the
        blocks its known tokens fill are registered for the prefix cache (a later step reads them after
        this one has written them: the device runs steps in order)."""
        self.stats.steps += 1
        start = time.perf_counter()
        launched = self.runner.launch(batch, self.in_flight[-1] if self.in_flight else None)
        for seq, T in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = start
            if T == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:  # the newest token, sampled last step
                self.stats.decode_tokens += T
            else:
                self.stats.prefill_tokens += T
            seq.num_computed_tokens += T
            self.scheduler.blocks.commit(seq)
        for row, seq in enumerate(launched.sampled):
            seq.num_pending += 1
            seq.pending_row = row
        return launched

    def _land(self, keep: int) -> list[RequestOutput]:
        """Land the steps in flight, oldest first, until `keep` are left -> their outputs: tokens appended,
        stops checked, the blocks the landed tokens filled registered. A step leaves the queue only once its
        ids have come back, so an interrupted wait can be taken up again."""
        outputs = []
        while len(self.in_flight) > keep:
            result = self.in_flight[0].land()
            self.in_flight.popleft()
            outputs += self._landed(result)
        return outputs

    def _landed(self, result: StepOutput) -> list[RequestOutput]:
        now = time.perf_counter()  # the sampled ids reached the host: the device is done
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        for seq, entries in result.prompt_logprobs:
            seq.prompt_logprobs.append(as_dict(entries, decode))
        outputs = []
        for seq, token, entries in zip(result.sampled, result.tokens, result.logprobs, strict=True):
            seq.num_pending -= 1
            if seq.status is Status.FINISHED:  # aborted, or stopped while this step was in flight
                continue
            seq.token_ids.append(token)
            if entries is not None:
                seq.logprobs.append(as_dict(entries, decode))
            seq.metrics.token_times.append(now)
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                seq.metrics.finished_time = now
                self.scheduler.remove(seq)
                del self.requests[seq.request_id]
            else:
                self.scheduler.blocks.commit(seq)  # the block its landed token filled, if any
            output = self._output(seq)
            if output is not None:
                outputs.append(output)
        return outputs

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.token_ids) >= seq.max_len:
            seq.finish_reason = "length"

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
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
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
        for seq in list(self.requests.values()):
            self.scheduler.remove(seq)
        self.requests.clear()
        if self.workers:
            stop_workers(self.runner, self.workers)
        self.in_flight.clear()
        self.runner = self.model = None
        gc.collect()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.runner is None:
            raise RuntimeError("this engine is closed")

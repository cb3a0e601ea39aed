"""LLMEngine: one model, one KV pool, one scheduler and runner, for as long as the engine lives.

vLLM's interface: `add_request` queues a request (every check runs here, before any work; `add_requests`
checks several before queueing any), `step` runs one forward pass over what the scheduler picks and returns
the outputs it produced, `abort_request` drops a request and frees its blocks at once. A request with structured
outputs waits outside the scheduler while its grammar compiles on the compiler's threads (seconds for a large one,
which hold up no step), and is queued once it has. Everything the engine holds is built in `__init__`: weights
are read once, the pool is sized once, CUDA graphs are captured once.
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
from concurrent import futures
from concurrent.futures import Future

import torch

from weft.errors import ParamTypeError, ParamValueError
from weft.inference.block_manager import BlockManager
from weft.inference.config import EngineConfig
from weft.inference.detokenizer import IncrementalDetokenizer
from weft.inference.inputs import PROMPT, parse_prompt
from weft.inference.outputs import CompletionOutput, EngineSnapshot, EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams, check_sampling_params
from weft.inference.ranks import RankGroup, build_rank
from weft.inference.runner import Launched, ModelRunner
from weft.inference.sampling import can_sample
from weft.inference.scheduler import SCHEDULERS, ScheduledBatch
from weft.inference.sequence import Sequence
from weft.inference.structured import GrammarCompiler
from weft.layers.bitmask import token_bitmask
from weft.models.llama import LlamaForCausalLM
from weft.models.loader import resolve_model
from weft.utils import freeze_heap

logger = logging.getLogger(__name__)

RequestId = str | int
# how long a step with nothing to run but grammars compiling waits for one: briefly, so that what comes meanwhile (an
# abort, a request) waits little
GRAMMAR_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        source = resolve_model(config.model, config.tokenizer)
        self.config = config = config.for_model(source.config)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.eos_token_ids = source.eos_token_ids
        # what a request that sets no sampling fields of its own samples with (config.generation_config)
        self.sampling_defaults = source.sampling_defaults if config.generation_config == "auto" else {}
        if self.sampling_defaults:
            try:  # a value SamplingParams refuses would refuse every request that leaves its field out
                SamplingParams(**self.sampling_defaults)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source.name}: generation_config.json's sampling defaults: {e} (generation_config="
                                 "'vllm' leaves them out)") from None
            logger.info("%s: sampling defaults from generation_config.json: %s", source.name, self.sampling_defaults)
        self.ranks = RankGroup.start(config)  # the other tensor-parallel ranks build theirs beside this one
        self.runner: ModelRunner | None
        self.runner, self.pool = build_rank(config, source, 0, self.ranks)
        logger.info("%s: %s", source.name, self.pool.describe(config))
        windowed = source.config.window_layers == tuple(range(source.config.L))  # every layer: blocks fall behind
        self.blocks = BlockManager(self.pool.num_blocks, self.pool.block_size, config.enable_prefix_caching,
                                   source.config.sliding_window if windowed else None, self.runner.attn.attends_by_role)
        self.scheduler = SCHEDULERS[config.scheduler](
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            self.eos_token_ids,
        )
        self.requests: dict[RequestId, list[Sequence]] = {}  # in flight (queued or running): its n completions
        self.grammars: GrammarCompiler | None = None  # built at the first request with structured outputs
        self.compiling: dict[RequestId, Future] = {}  # requests waiting for their grammar, in order: not queued yet
        self.in_flight: deque[Launched] = deque()  # steps queued on the device, not landed yet (oldest first)
        self.stats = EngineStats()
        # what the process holds now (its modules, the model, the tokenizer) mostly lives as long as the engine: frozen,
        # a full collection no longer walks it, where one inside a run stalled it 200-250 ms, and in the server the
        # walks took tens of microseconds of each request's output a step (ff6b54b). vLLM's engine core does the same.
        freeze_heap()

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
        checked = [self._sequences(*request, now) for request in zip(request_ids, prompts, params, labels, strict=True)]
        ids = [group[0].request_id for group, _ in checked]
        for i, rid in enumerate(ids):
            if rid in self.requests or rid in ids[:i]:
                raise ParamValueError(f"{labels[i]}: request id {rid!r} is already in flight")
        for rid, (group, grammar) in zip(ids, checked, strict=True):
            self.requests[rid] = group
            if grammar is None or grammar.done():  # a grammar in the cache: queued in its turn
                self._queue(group, grammar)
            else:
                self.compiling[rid] = grammar

    def _queue(self, group: list[Sequence], grammar: Future | None) -> None:
        """Queue a request; with the grammar its matchers wait for (compiled), its matchers first."""
        if grammar is not None:
            self._match(group, grammar.result())
        for seq in group:
            self.scheduler.add(seq)

    def _match(self, group: list[Sequence], grammar: object) -> None:
        for seq in group:
            seq.matcher = self.grammars.matcher(grammar)

    def _compiled(self, wait: bool) -> None:
        """Queue the requests whose grammar is compiled, in the order they came. With `wait` (nothing else to run),
        first wait a little for one: a command that comes meanwhile (an abort, a request) waits at most
        GRAMMAR_WAIT_S."""
        if wait:
            futures.wait(self.compiling.values(), GRAMMAR_WAIT_S, futures.FIRST_COMPLETED)
        for rid in [rid for rid, grammar in self.compiling.items() if grammar.done()]:
            self._queue(self.requests[rid], self.compiling.pop(rid))

    def _sequences(self, request_id: RequestId, prompt: object, params: object, label: str, now: float
                   ) -> tuple[list[Sequence], Future | None]:
        """A checked request's n completions, queued nowhere yet, and the grammar its matchers wait for (compiled or
        compiling; None if it has none, or has them already)."""
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            raise ParamTypeError(f"request_id must be a str or an int, got {request_id!r}")
        params = check_sampling_params(params, label)
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.V, label)
        ids, cfg = parsed.token_ids, self.config
        self._check_params(params, label)
        if params.truncate_prompt_tokens is not None:  # the prompt's last k tokens, as vLLM keeps
            keep = cfg.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
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
        self._check_room(len(ids), params, label)
        max_tokens = params.max_tokens or cfg.max_model_len
        max_len = min(len(ids) + max_tokens, cfg.max_model_len)
        need = self.blocks.blocks_for(max_len - 1)
        if need > self.blocks.num_blocks:
            raise ParamValueError(
                f"{label} needs {max_len - 1} cache slots ({need} blocks of {self.blocks.block_size}); "
                f"the pool has {self.blocks.num_blocks} blocks, so it could never run", PROMPT,
            )
        bad_words = self._bad_words(params.bad_words)
        listed = params.allowed_token_ids
        allowed = token_bitmask(listed, self.model_config.V) if listed is not None else None  # its n completions'
        group: list[Sequence] = []
        for index in range(params.n):
            child = params.child(index) if params.n > 1 else params
            seq = Sequence(
                request_id=request_id, token_ids=list(ids), num_prompt_tokens=len(ids), params=child,
                max_len=max_len, metrics=RequestMetrics(now), prompt=parsed.text, index=index,
                first=group[0] if group else None, bad_words_ids=bad_words, allowed=allowed,
            )  # fmt: skip
            if self.tokenizer is not None and child.detokenize and (
                child.output_kind is not RequestOutputKind.FINAL_ONLY or child.stop
            ):
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
            if child.logprobs is not None:
                seq.logprobs = []
            if child.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]  # nothing predicts the first token
            group.append(seq)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)  # parsed here: an invalid one is refused now
            if params.allowed_token_ids is not None or params.bad_words or params.min_tokens:
                # rules that may leave its grammar no first token: that is a ValueError too, so its compile is waited
                # for here (the other requests wait with it, as before grammars compiled on threads of their own)
                self._match(group, grammar.result())
                grammar = None
        if not can_sample(group[0], tuple(self.eos_token_ids), self.model_config.V):
            raise ParamValueError(
                f"{label}: its rules allow no first token (allowed_token_ids, bad_words, min_tokens' bans and "
                "structured_outputs together leave none)", "allowed_token_ids",
            )
        return group, grammar

    def _check_room(self, num_prompt_tokens: int, params: SamplingParams, label: str) -> None:
        """What to do with a max_tokens larger than the context the prompt leaves: nothing, here (the request stops at
        the context, as vLLM's offline engine's do); weft serve's engine refuses it (weft.serve.served_engine)."""

    def _check_params(self, params: SamplingParams, label: str) -> None:
        """What SamplingParams cannot check alone: token ids within the vocabulary, logprobs within max_logprobs,
        a tokenizer for what is text (stop strings, bad words, grammars)."""
        V = self.model_config.V
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids or () if not 0 <= t < V), None)
            if bad is not None:
                raise ParamValueError(f"{label}: {name} holds token id {bad}, outside the vocabulary [0, {V})", name)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ParamValueError(f"{label}: {name} is {k}, more than max_logprobs={self.config.max_logprobs}",
                                      name)
        for name in ("stop", "bad_words", "structured_outputs"):
            if getattr(params, name) and self.tokenizer is None:
                raise ParamValueError(f"{label}: {name} needs a tokenizer, and this model has none", name)
        if params.structured_outputs is not None and self.grammars is None:
            # a model without EOS ids of its own (a random shape given a tokenizer) ends grammars at the tokenizer's
            self.grammars = GrammarCompiler(self.tokenizer, V, self.eos_token_ids or None)

    def _bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it would begin the text and, where they differ, as a word within it (after a
        space), as vLLM bans them."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out += [alone] if spaced == alone or not spaced else [alone, spaced]
        return tuple(w for w in out if w)

    def abort_request(self, request_id: RequestId | Iterable[RequestId]) -> None:
        """Drop requests (unknown or finished ids are ignored, as in vLLM); their blocks are free at once."""
        ids = [request_id] if isinstance(request_id, str | int) else list(request_id)
        for rid in ids:
            grammar = self.compiling.pop(rid, None)
            if grammar is not None:  # never queued; its compile, if no other request waits for it, not started
                del self.requests[rid]
                if all(other is not grammar for other in self.compiling.values()):
                    self.grammars.drop(grammar)
                continue
            for seq in self.requests.pop(rid, ()):
                if seq.finish_reason is None:
                    self.scheduler.remove(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges now and a copy of its counters: one reading, for the server's /metrics."""
        compiling = sum(len(self.requests[rid]) for rid in self.compiling)
        return EngineSnapshot(len(self.scheduler.running), self.scheduler.num_waiting + compiling,
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
        if self.compiling:
            self._compiled(wait=not self.in_flight and not self.scheduler.has_work())
        batch = self.scheduler.schedule()
        self._count(batch)
        if not batch:
            if not self.in_flight and self.scheduler.has_work() and not batch.preempted:
                raise RuntimeError("the scheduler made no progress: this is a weft bug, please report it")
            return outputs + self._land(keep=0)
        launched, landed = self._launch(batch)
        overlap = self.config.enable_overlap and not launched.lands_at_once
        return outputs + landed + self._land(keep=1 if overlap else 0)

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

    def _launch(self, batch: ScheduledBatch) -> tuple[Launched, list[RequestOutput]]:
        """Queue `batch` on the device (after the steps in flight, whose ids it may read there) -> the step, and
        the outputs of the steps that landed meanwhile: where a sampled request's logit rules need its tokens on
        the host (a grammar, a bad word), every step before lands after the forward pass is queued, while the
        device runs it, and before the sampling is."""
        start = time.perf_counter()
        step = self.runner.launch_forward(batch, self.in_flight[-1] if self.in_flight else None)
        landed = self._land(keep=0) if step.needs_host_tokens else []
        launched = self.runner.launch_sampling(step)
        self.scheduler.launched(batch, launched.sampled, start)
        self.in_flight.append(launched)
        return launched, landed

    def _land(self, keep: int) -> list[RequestOutput]:
        """Land the steps in flight, oldest first, until `keep` are left -> their outputs. A step leaves the
        queue only once its ids have come back, so an interrupted wait can be taken up again."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        outputs = []
        while len(self.in_flight) > keep:
            step = self.in_flight[0].land(decode)
            self.in_flight.popleft()
            took: dict[RequestId, list[Sequence]] = {}  # the requests whose completions took a token, in order
            for seq in self.scheduler.landed(step):
                self.stats.generation_tokens += 1
                if len(seq.token_ids) == seq.num_prompt_tokens + 1 and seq.index == 0:
                    self.stats.prompt_tokens += seq.num_prompt_tokens
                took.setdefault(seq.request_id, []).append(seq)
            for rid, seqs in took.items():
                group = self.requests[rid]
                finished = all(seq.finish_reason is not None for seq in group)
                if finished:
                    del self.requests[rid]
                output = self._output(group, seqs, finished)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _output(self, group: list[Sequence], took: list[Sequence], finished: bool) -> RequestOutput | None:
        """A request's output after a step in which its completions `took` took a token: as its output_kind says,
        those completions' new tokens and text (DELTA), all of every completion (CUMULATIVE), or all of every
        completion once the last has finished (FINAL_ONLY). Its metrics are its first completion's."""
        first, kind = group[0], group[0].params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        is_delta = kind is RequestOutputKind.DELTA
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None:  # a delta carries them once, before any completion has returned a token
            opening = not is_delta or all(seq.num_returned_tokens == 0 for seq in group)
            prompt_logprobs = list(prompt_logprobs) if opening else None
        completions = [self._completion(seq, is_delta) for seq in (took if is_delta else group)]
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions, finished,
                             first.metrics, prompt_logprobs, first.num_cached_tokens)

    def _completion(self, seq: Sequence, is_delta: bool) -> CompletionOutput:
        """One completion's output: all of it, or what it has not handed out yet (`is_delta`). A stop string may be
        starting at the end of its text: those characters wait until it has finished or they are decided."""
        returned = seq.num_returned_tokens if is_delta else 0
        ids = seq.token_ids[seq.num_prompt_tokens + returned :]  # a delta copies only its own
        logprobs = seq.logprobs[returned:] if seq.logprobs is not None else None
        if is_delta:
            seq.num_returned_tokens = returned + len(ids)
        p, done = seq.params, seq.finish_reason is not None
        if seq.detokenizer is not None:
            text = seq.detokenizer.text
            hold = 0 if done or p.include_stop_str_in_output else max(map(len, p.stop), default=1) - 1
            end = max(seq.num_returned_chars, len(text) - hold)
            start = seq.num_returned_chars if is_delta else 0
            if is_delta:
                seq.num_returned_chars = end
            text = text[start:end]
        elif self.tokenizer is not None and p.detokenize:  # FINAL_ONLY, finished: decoded as a stream would be, at once
            text = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids).add(ids, final=True)
        else:
            text = ""
        return CompletionOutput(seq.index, text, ids, seq.finish_reason, seq.stop_reason, logprobs)

    # ---- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the model, the pool, the CUDA graphs and the grammars; the engine refuses work from here on. What the
        process holds then stays frozen, as the engine's build froze it: a reference cycle among those objects that
        becomes garbage later is freed at the next engine's close (or at exit)."""
        if self.runner is None:
            return
        # the engine's objects, frozen with the heap it was built on, may be freed now, cycles too
        gc.unfreeze()
        self.abort_request(list(self.requests))
        self.ranks.stop(self.runner)
        self.in_flight.clear()
        self.runner = None
        if self.grammars is not None:
            self.grammars.close()
        self.grammars = None  # its compiled grammars' cache is a cycle
        # one full collection frees them; what is left is frozen again, so that the next engine's build (a test
        # suite's hundreds) walks only what came after, not the whole heap a second time
        freeze_heap()
        if self.config.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.runner is None:
            raise RuntimeError("this engine is closed")

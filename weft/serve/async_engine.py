"""AsyncEngine: one LLMEngine in a process of its own, fed and drained from the server's event loop.

The engine process owns the model, the tokenizer and the GPU: every call into the engine
(checking and queueing a request, aborting one, stepping) runs there, between steps, and the
event loop never waits on the GPU nor shares an interpreter lock with the engine's host work.
Commands go down one pipe; each step's new tokens come back up another as one message of small
tuples (a request's prompt ids only with its first piece, its timings only with its last), with
a snapshot of the engine's counters for /metrics. A reader thread hands each message to the loop
in one `call_soon_threadsafe`. Requests the engine refuses come back as their ValueError or
TypeError before any work; if the engine process dies (a step raised, or it was killed), every
request in flight gets EngineDead and the server reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from weft.inference.config import EngineConfig
from weft.inference.outputs import CompletionOutput, RequestMetrics, RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine process waits on its pipe before waiting again
STOP_WAIT_S = 30.0


class QueueFull(Exception):
    """More requests are waiting than the server takes (--max-queued-requests)."""


class EngineDead(Exception):
    """The engine process has stopped: a step raised, it was killed, or the server is shutting down."""


@dataclass(frozen=True)
class Conversation:
    """A chat's messages, rendered through the chat template in the engine process (the tokenizer's home)."""

    messages: object


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once its engine is built."""

    model_name: str
    max_model_len: int
    num_blocks: int


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """The engine's gauges and counters as of its last message (GET /metrics)."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


# A piece of one request's output, as the engine process sends it: (request id, new token ids, new text,
# finish reason, stop reason, prompt ids | None, metrics | None, their logprobs | None), or
# (request id, exception) for a request the engine refused.
Piece = tuple


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_queued_requests: int | None = None) -> None:
        """Start the engine process and wait until its engine is built (ValueError if it cannot be)."""
        self.max_queued_requests = max_queued_requests
        spawn = multiprocessing.get_context("spawn")  # CUDA cannot be forked; the child starts clean
        commands_out, self._commands_in = spawn.Pipe(duplex=False)
        self._outputs_out, outputs_in = spawn.Pipe(duplex=False)
        self.process = spawn.Process(target=engine_main, args=(config, commands_out, outputs_in),
                                     name="weft-engine",
                                     daemon=config.tensor_parallel_size == 1)  # a daemon cannot start the TP ranks
        self.process.start()
        commands_out.close()
        outputs_in.close()
        try:
            first = self._outputs_out.recv()
        except EOFError:
            first = f"the engine process exited with {self.process.exitcode} before its engine was built"
        if not isinstance(first, EngineInfo):
            self.process.join(STOP_WAIT_S)
            raise ValueError(first)
        self.info = first
        self.stats = EngineStatsSnapshot(blocks_total=first.num_blocks)
        self.streams: dict[str, asyncio.Queue] = {}  # the event loop's alone
        self.prompts: dict[str, list[int]] = {}  # each streaming request's prompt ids, from its first piece
        self.sent = 0  # requests sent to the engine and not yet seen there (loop side)
        self.dead: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()

    # ---- the event loop's side ------------------------------------------------------------------

    def start(self) -> None:
        """Begin delivering outputs into the running event loop."""
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="weft-engine-reader", daemon=True).start()

    def stop(self) -> None:
        self.dead = "the server stopped it"
        self._send(None)
        self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()

    @property
    def running(self) -> bool:
        return self.dead is None and self.process.is_alive()

    async def generate(
        self, request_id: str, prompt: object, params: SamplingParams, label: str = "prompt"
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (DELTA: each holds its step's new tokens).

        The first `__anext__` raises the engine's own ValueError / TypeError for a request it refuses,
        QueueFull or EngineDead. Leaving the iteration early (a client gone) aborts the request.
        """
        if not self.running:
            raise EngineDead(f"the engine process is not running: {self.dead}")
        waiting = self.stats.waiting + self.sent
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise QueueFull(f"{waiting} requests are waiting, the most this server queues (--max-queued-requests)")
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = stream
        self.sent += 1
        self._send(("add", request_id, prompt, params, label))
        finished, held = False, None
        try:
            while True:
                item, held = (held, None) if held is not None else (await stream.get(), None)
                if isinstance(item, BaseException):
                    raise item
                # a consumer that fell behind the engine takes every output waiting as one (deltas joined, else
                # the newest): a chunk costs the server the same whatever it carries, so it catches up
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = joined(item, later) if params.output_kind == RequestOutputKind.DELTA else later
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            self.prompts.pop(request_id, None)
            if not finished and self.running:
                self._send(("abort", request_id))

    def _send(self, command: object) -> None:
        with self._send_lock:  # the loop and stop() may both send
            try:
                self._commands_in.send(command)
            except (BrokenPipeError, OSError):
                pass  # the engine is gone; the reader reports it

    def _deliver(self, message: tuple[list[Piece], EngineStatsSnapshot, int]) -> None:
        """On the loop: each piece into its request's stream, as a RequestOutput."""
        pieces, self.stats, admitted = message
        self.sent -= admitted
        for piece in pieces:
            stream = self.streams.get(piece[0])
            if stream is None:
                continue
            if len(piece) == 2:
                stream.put_nowait(piece[1])
                continue
            rid, token_ids, text, finish_reason, stop_reason, prompt_ids, metrics, logprobs = piece
            if prompt_ids is not None:
                self.prompts[rid] = prompt_ids
            completion = CompletionOutput(0, text, token_ids, finish_reason, stop_reason, logprobs)
            finished = finish_reason is not None
            stream.put_nowait(RequestOutput(rid, None, self.prompts.get(rid, []), [completion], finished,
                                            metrics if metrics is not None else _NO_METRICS))

    def _die(self, reason: str) -> None:
        """On the loop: the engine is gone; every request still streaming gets EngineDead."""
        self.dead = reason
        for stream in list(self.streams.values()):
            stream.put_nowait(EngineDead(f"the engine process died: {reason}"))

    def _read(self) -> None:
        """The reader thread: the engine's messages into the loop, until the pipe closes."""
        while True:
            try:
                message = self._outputs_out.recv()
            except (EOFError, OSError):
                self.process.join(1.0)
                reason = f"it exited with {self.process.exitcode}"
                break
            if isinstance(message, str):  # the engine's last words
                reason = message
                break
            self.loop.call_soon_threadsafe(self._deliver, message)
        if self.dead is not None:  # stopped on purpose
            return
        logger.error("the engine process died: %s", reason)
        try:
            self.loop.call_soon_threadsafe(self._die, reason)
        except RuntimeError:  # the event loop is gone too
            pass


_NO_METRICS = RequestMetrics(0.0)  # pieces before the last carry no timings


def joined(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of one request as one: tokens, text and logprobs in order, the
    later one's finish and timings."""
    a, b = first.outputs[0], later.outputs[0]
    logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
    completion = CompletionOutput(0, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason, b.stop_reason,
                                  logprobs)
    return RequestOutput(first.request_id, None, first.prompt_token_ids, [completion], later.finished, later.metrics)


# ---- the engine process -----------------------------------------------------------------------------


def engine_main(config: EngineConfig, commands, outputs) -> None:
    """The engine process: build the engine, then run commands and steps until told to stop."""
    from weft.inference.chat import chat_prompt
    from weft.inference.engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 (whatever it is, the server must say it and exit)
        outputs.send(f"{type(e).__name__}: {e}")
        return
    outputs.send(EngineInfo(engine.model_name, engine.config.max_model_len, engine.pool.num_blocks))
    started: set[str] = set()  # requests whose prompt ids went out with their first piece
    try:
        while True:
            if not engine.has_unfinished_requests() and not commands.poll(IDLE_WAIT_S):
                continue
            pieces: list[Piece] = []
            admitted = 0
            while commands.poll():
                command = commands.recv()
                if command is None:
                    return
                if command[0] == "abort":
                    engine.abort_request(command[1])
                    started.discard(command[1])
                    continue
                _, rid, prompt, params, label = command
                admitted += 1
                try:
                    if isinstance(prompt, Conversation):
                        prompt = chat_prompt(engine.tokenizer, prompt.messages, engine.model_name)
                    engine.enqueue(engine.make_request(rid, prompt, params, label=label))
                except (ValueError, TypeError) as e:  # refused before any work
                    pieces.append((rid, e))
            if engine.has_unfinished_requests():
                for out in engine.step():
                    c = out.outputs[0]
                    first = out.request_id not in started
                    started.add(out.request_id)
                    if out.finished:
                        started.discard(out.request_id)
                    pieces.append((out.request_id, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                                   out.prompt_token_ids if first else None, out.metrics if out.finished else None,
                                   c.logprobs))
            outputs.send((pieces, _snapshot(engine), admitted))
    except BaseException as e:  # noqa: BLE001 (a step raised: the engine's state is no longer trusted)
        logger.exception("the engine process is stopping: a step raised")
        outputs.send(f"{type(e).__name__}: {e}")


def _snapshot(engine) -> EngineStatsSnapshot:
    scheduler, stats = engine.scheduler, engine.stats
    blocks = scheduler.blocks
    return EngineStatsSnapshot(
        len(scheduler.running), len(scheduler.waiting), blocks.num_blocks - blocks.num_free, blocks.num_blocks,
        stats.num_preemptions, stats.prefill_tokens, stats.decode_tokens, stats.steps, stats.prefix_cache_queries,
        stats.prefix_cache_hits,
    )

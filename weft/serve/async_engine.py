"""AsyncEngine: one LLMEngine driven by a thread of its own, fed and drained from asyncio.

Every call into the engine (checking and queueing a request, aborting one, stepping) runs on
the engine thread, between steps: the engine and its tokenizer are never used from two threads
at once, and the event loop never waits on the GPU. Requests come in through a thread-safe
command queue; each step's outputs go back to the loop in one `call_soon_threadsafe`, which
hands every request its own pieces. If a step raises, the engine may be half-way through its
bookkeeping: every request in flight gets the error and the loop stops (`dead`); checks refuse
bad requests before they reach a step, so one bad request never gets that far.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from weft.inference.chat import chat_prompt
from weft.inference.engine import LLMEngine
from weft.inference.outputs import RequestOutput
from weft.inference.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine thread blocks on its queue before looking at `stopping` again


class QueueFull(Exception):
    """More requests are waiting than the server takes (--max-queued-requests)."""


class EngineDead(Exception):
    """The engine loop has stopped: a step raised, or the server is shutting down."""


@dataclass(frozen=True)
class Conversation:
    """A chat's messages, rendered through the chat template on the engine thread (the tokenizer's only user)."""

    messages: object


@dataclass
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    label: str  # names the request in the engine's errors, in the client's terms ("prompt 1", "messages")
    stream: asyncio.Queue  # RequestOutput pieces, then None; or an exception


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self.streams: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self.queued = 0  # requests sent to the engine thread and not yet admitted or finished (loop side)
        self.dead: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    # ---- the event loop's side ------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(target=self._run, name="weft-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.commands.put(None)
        if self.thread is not None:
            self.thread.join()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.dead is None

    async def generate(
        self, request_id: str, prompt: object, params: SamplingParams, label: str = "prompt"
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (`params.output_kind` says what each holds).

        The first `__anext__` raises the engine's own ValueError / TypeError for a request it refuses,
        QueueFull or EngineDead. Leaving the iteration early (a client gone) aborts the request.
        """
        if not self.running:
            raise EngineDead("the engine loop is not running")
        waiting = len(self.engine.scheduler.waiting) + self.queued
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise QueueFull(f"{waiting} requests are waiting, the most this server queues (--max-queued-requests)")
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = stream
        self.queued += 1
        self.commands.put(_Add(request_id, prompt, params, label, stream))
        finished = False
        try:
            while True:
                item = await stream.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            if not finished:
                self.commands.put(_Abort(request_id))

    def _deliver(self, pieces: list[tuple[str, object]]) -> None:
        """On the loop: each (request id, output or exception or None) into its request's stream."""
        for request_id, item in pieces:
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _admitted(self, count: int) -> None:
        self.queued -= count

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while self._take_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self.loop.call_soon_threadsafe(self._deliver, [(o.request_id, o) for o in outputs])
        except BaseException as e:  # a step raised: the engine's state is no longer trusted
            logger.exception("the engine loop died")
            self.dead = e
            self.loop.call_soon_threadsafe(self._fail_all, EngineDead(f"the engine loop died: {type(e).__name__}: {e}"))

    def _take_commands(self, block: bool) -> bool:
        """Run every command waiting, the first awaited (a while) when `block`; False: stop the loop."""
        try:
            command = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while self._handle(command):
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _handle(self, command: _Add | _Abort | None) -> bool:
        """Run one command on the engine thread; False: stop the loop."""
        loop = self.loop
        if command is None:
            return False
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return True
        engine = self.engine
        try:
            prompt = command.prompt
            if isinstance(prompt, Conversation):
                prompt = chat_prompt(engine.tokenizer, prompt.messages, engine.model_name)
            engine.enqueue(engine.make_request(command.request_id, prompt, command.params, label=command.label))
        except (ValueError, TypeError) as e:  # the engine refused it before any work
            loop.call_soon_threadsafe(self._deliver, [(command.request_id, e)])
        loop.call_soon_threadsafe(self._admitted, 1)
        return True

    def _fail_all(self, error: EngineDead) -> None:
        """On the loop: every request still streaming gets the error."""
        self._deliver([(rid, error) for rid in list(self.streams)])

"""AsyncEngine: one LLMEngine in a process of its own, fed and drained from the server's event loop.

The engine process owns the model and the GPU: every call into the engine (checking and queueing a request,
aborting one, stepping) runs there, between steps, and the event loop never waits on the GPU nor shares an
interpreter lock with the engine's host work. The server holds a copy of the tokenizer, as vLLM's API server does:
text prompts and conversations become token ids on a thread of its own, so a long prompt holds up no step (nor the
event loop: HF's tokenizers let go of the interpreter lock).
Commands go down one pipe and each step's pieces come back up another, as the typed messages of
weft.serve.messages; a reader thread hands each message to the loop in one `call_soon_threadsafe`. In the engine
process a thread of its own serves each end (as vLLM's engine core has input and output threads): the steps never
wait on a pipe, nor the server's sends on a step.
A stream's text is decoded here, from its pieces' token ids, unless it has stop strings (the engine finds
those in its text): the engine process then spends none of a step's host time on it, as in vLLM, whose
engine core sends token ids and whose API server's process detokenizes.
Requests the engine refuses come back as their ValueError or TypeError (with the field at fault)
before any work; if the engine process dies (a step raised, or it was killed), every request in
flight gets EngineDead and the server reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from weft.inference.chat import chat_prompt
from weft.inference.config import EngineConfig
from weft.inference.detokenizer import IncrementalDetokenizer
from weft.inference.inputs import parse_prompt
from weft.inference.outputs import CompletionOutput, EngineSnapshot, EngineStats, RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams
from weft.models.loader import resolve_model
from weft.serve.messages import (
    AbortRequest,
    AddRequest,
    Command,
    Conversation,
    EngineFailed,
    EngineReady,
    Refusal,
    Shutdown,
    StepMessage,
    pack,
    unpack,
)

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0
STOP = object()  # what ends the engine process's sender thread


class QueueFull(Exception):
    """More requests are waiting than the server takes (--max-queued-requests)."""


class EngineDead(Exception):
    """The engine process has stopped: a step raised, it was killed, or the server is shutting down."""


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
            first = EngineFailed(f"the engine process exited with {self.process.exitcode} before its engine was built")
        if not isinstance(first, EngineReady):
            self.process.join(STOP_WAIT_S)
            raise ValueError(first.reason)
        self.info = first
        # the server's own copy of the tokenizer (prompts, conversations, /tokenize, /detokenize), used on one thread:
        # HF's tokenizers are not thread-safe
        source = resolve_model(config.model, config.tokenizer)
        self.tokenizer, self.vocab_size = source.tokenizer, source.config.V
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="weft-tokenizer")
        self.snapshot = EngineSnapshot(0, 0, 0, first.num_blocks, EngineStats())  # as of the engine's last message
        self.streams: dict[str, asyncio.Queue] = {}  # the event loop's alone
        self.prompts: dict[str, list[int]] = {}  # each unfinished request's prompt ids, from its first piece
        # the streams whose text is decoded here: each completion's detokenizer, by its index
        self.texts: dict[str, dict[int, IncrementalDetokenizer]] = {}
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
        self._send(Shutdown())
        self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def tokenizing(self, call: Callable[..., object], *args: object) -> object:
        """call(*args) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, call, *args)

    def token_ids(self, prompt: str | Conversation, label: str) -> list[int]:
        """A text prompt's or a conversation's token ids, as the engine would make them (its ValueError / TypeError
        for one it would refuse)."""
        if isinstance(prompt, Conversation):
            return chat_prompt(self.tokenizer, prompt.messages, self.info.model_name, **prompt.options)
        return parse_prompt(prompt, self.tokenizer, self.vocab_size, label).token_ids

    @property
    def running(self) -> bool:
        return self.dead is None and self.process.is_alive()

    async def generate(
        self, request_id: str, prompt: object, params: SamplingParams, label: str = "prompt"
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them, as `params.output_kind` says (DELTA: each holds its
        step's new tokens; FINAL_ONLY: one, the whole completion). Outputs before the last carry no metrics.

        The first `__anext__` raises the engine's own ValueError / TypeError for a request it refuses,
        QueueFull or EngineDead. Leaving the iteration early (a client gone) aborts the request. A text prompt or a
        conversation is tokenized here, on the tokenizer's thread; outputs carry a text prompt as sent.
        """
        if not self.running:
            raise EngineDead(f"the engine process is not running: {self.dead}")
        waiting = self.snapshot.num_waiting + self.sent
        if self.max_queued_requests is not None and waiting >= self.max_queued_requests:
            raise QueueFull(f"{waiting} requests are waiting, the most this server queues (--max-queued-requests)")
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str | Conversation):
            prompt = await self.tokenizing(self.token_ids, prompt, label)
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = stream
        self.sent += 1
        if self.tokenizer is not None and params.output_kind is RequestOutputKind.DELTA and not params.stop:
            self.texts[request_id] = {}
            params = replace(params, detokenize=False)
        self._send(AddRequest(request_id, prompt, params, label))
        finished, held = False, None
        try:
            while True:
                item, held = (held, None) if held is not None else (await stream.get(), None)
                if isinstance(item, BaseException):
                    raise item
                # a consumer that fell behind the engine takes every output waiting as one (deltas joined, else the
                # newest): a chunk costs the server the same whatever it carries, so it catches up
                while not item.finished and not stream.empty():
                    later = stream.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = joined(item, later) if params.output_kind is RequestOutputKind.DELTA else later
                finished = item.finished
                item.prompt = text
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request_id, None)
            self.prompts.pop(request_id, None)
            self.texts.pop(request_id, None)
            if not finished and self.running:
                self._send(AbortRequest(request_id))

    def _send(self, command: Command) -> None:
        with self._send_lock:  # the loop and stop() may both send
            try:
                self._commands_in.send(command)
            except (BrokenPipeError, OSError):
                pass  # the engine is gone; the reader reports it

    def _deliver(self, message: StepMessage) -> None:
        """On the loop: each refusal and piece into its request's stream (a piece as a RequestOutput)."""
        self.snapshot = message.snapshot
        self.sent -= message.admitted
        for refusal in message.refusals:
            stream = self.streams.get(refusal.request_id)
            if stream is not None:
                stream.put_nowait(refusal.error())
        for piece in message.pieces:
            stream = self.streams.get(piece[0])
            if stream is None:
                continue
            out = unpack(piece, self.prompts)
            if (detokenizers := self.texts.get(out.request_id)) is not None:
                for completion in out.outputs:
                    self._decode(completion, detokenizers, out.prompt_token_ids)
            stream.put_nowait(out)

    def _decode(self, completion: CompletionOutput, detokenizers: dict[int, IncrementalDetokenizer],
                prompt_ids: list[int]) -> None:
        """Fill in a delta's text as the engine would have decoded it: token by token, and what an incomplete last
        character held back once the completion has finished."""
        detok = detokenizers.get(completion.index)
        if detok is None:
            detok = detokenizers[completion.index] = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        text = "".join(detok.add([token], final=False) for token in completion.token_ids)
        if completion.finish_reason is not None:
            text += detok.add([], final=True)
        completion.text = text

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
            if isinstance(message, EngineFailed):  # the engine's last words
                reason = message.reason
                break
            self.loop.call_soon_threadsafe(self._deliver, message)
        if self.dead is not None:  # stopped on purpose
            return
        logger.error("the engine process died: %s", reason)
        try:
            self.loop.call_soon_threadsafe(self._die, reason)
        except RuntimeError:  # the event loop is gone too
            pass


def joined(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of one request as one: each completion's tokens, text and logprobs in order
    (by index), the later one's finish and timings, the first's prompt logprobs and cached count."""
    merged = {c.index: c for c in first.outputs}
    for b in later.outputs:
        a = merged.get(b.index)
        if a is None:
            merged[b.index] = b
            continue
        logprobs = a.logprobs + b.logprobs if a.logprobs is not None and b.logprobs is not None else None
        merged[b.index] = CompletionOutput(b.index, a.text + b.text, a.token_ids + b.token_ids, b.finish_reason,
                                           b.stop_reason, logprobs)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids,
                         sorted(merged.values(), key=lambda c: c.index),
                         later.finished, later.metrics, first.prompt_logprobs, first.num_cached_tokens)


# ---- the engine process -----------------------------------------------------------------------------


def engine_main(config: EngineConfig, commands, outputs) -> None:
    """The engine process: build the engine, then run commands and steps until told to stop."""
    from weft.serve.served_engine import ServedEngine

    try:
        engine = ServedEngine(config)
    except BaseException as e:  # noqa: BLE001 (whatever it is, the server must say it and exit)
        outputs.send(EngineFailed(f"{type(e).__name__}: {e}"))
        return
    outputs.send(EngineReady(engine.model_name, engine.config.max_model_len, engine.pool.num_blocks,
                             engine.sampling_defaults))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=receive_all, args=(commands, inbox), name="weft-engine-receiver", daemon=True).start()
    sender = threading.Thread(target=send_all, args=(outbox, outputs, inbox), name="weft-engine-sender", daemon=True)
    sender.start()
    try:
        step_loop(engine, inbox, outbox)
    except BaseException as e:  # noqa: BLE001 (a step raised: the engine's state is no longer trusted)
        logger.exception("the engine process is stopping: a step raised")
        outbox.put(EngineFailed(f"{type(e).__name__}: {e}"))
        outbox.put(STOP)
        sender.join()  # the server learns why before the pipe closes


def receive_all(commands, inbox: queue.SimpleQueue) -> None:
    """The engine process's receiver thread (vLLM's engine core has an input thread): each command from the pipe into
    `inbox` as it comes, so that the server's sends never wait on a step (a burst's prompts outgrow the pipe's
    buffer), until Shutdown. The pipe's end (the server is gone) reads as Shutdown; a command that cannot be read
    goes into `inbox` as its error, for the step loop to raise."""
    while True:
        try:
            command = commands.recv()
        except EOFError:
            command = Shutdown()
        except BaseException as e:  # noqa: BLE001 (the server must hear of it, as of a step that raised)
            inbox.put(e)
            return
        inbox.put(command)
        if isinstance(command, Shutdown):
            return


def send_all(outbox: queue.SimpleQueue, outputs, inbox: queue.SimpleQueue) -> None:
    """The engine process's sender thread (as vLLM's engine core has an output thread): each message from `outbox`
    down the pipe in order, until STOP. A step never waits on the pipe while the server reads more slowly than the
    engine steps; the step messages that queue meanwhile go as one (StepMessage.joined). Once it stops (STOP, the
    server gone, or a message that cannot be sent, whose error the server is told) it puts Shutdown in `inbox`: with
    no sender the step loop has nothing left to do."""
    try:
        message = outbox.get()
        while message is not STOP:
            waiting, after = [message], None  # after: a message taken from the queue that does not join them
            while isinstance(message, StepMessage) and not outbox.empty():
                after = outbox.get()
                if not isinstance(after, StepMessage):
                    break
                waiting.append(after)
                after = None
            outputs.send(StepMessage.joined(waiting) if len(waiting) > 1 else message)
            message = after if after is not None else outbox.get()
    except OSError:  # the server is gone
        pass
    except Exception as e:  # noqa: BLE001 (a message that cannot be sent: the server must hear why)
        logger.exception("the engine process is stopping: a message could not be sent")
        with contextlib.suppress(OSError):
            outputs.send(EngineFailed(f"{type(e).__name__}: {e}"))
    finally:
        inbox.put(Shutdown())


def step_loop(engine, inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
    """Run the commands in `inbox` (raising an error the receiver put there) and steps until Shutdown, each step's
    message into `outbox`."""
    started: set[str] = set()  # requests whose prompt ids went out with their first piece
    while True:
        commands = [] if engine.has_unfinished_requests() else [inbox.get()]  # idle: wait for a command
        while not inbox.empty():
            commands.append(inbox.get())
        refusals, admitted = [], 0
        for command in commands:
            if isinstance(command, BaseException):
                raise command
            if isinstance(command, Shutdown):
                return
            if isinstance(command, AbortRequest):
                engine.abort_request(command.request_id)
                started.discard(command.request_id)
                continue
            admitted += 1
            try:
                engine.add_request(command.request_id, command.prompt, command.params, label=command.label)
            except (ValueError, TypeError) as e:  # refused before any work
                refusals.append(Refusal.of(command.request_id, e))
        pieces = []
        if engine.has_unfinished_requests():
            for out in engine.step():
                first = out.request_id not in started
                started.add(out.request_id)
                if out.finished:
                    started.discard(out.request_id)
                pieces.append(pack(out, first))
        outbox.put(StepMessage(pieces, refusals, engine.snapshot(), admitted))


"""`weft serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one persistent engine.

    POST /v1/completions        prompt: text, token ids, or a list of them; SSE with "stream": true
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models, /health (503 once the engine process has died), /metrics (Prometheus)

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad body or
a request the engine refuses (the engine's own checks and words), 404 for another model's name,
429 when --max-queued-requests are waiting, 503 when the engine process is gone, 500 for a failure
while serving one request (that request only).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weft.inference.chat import MESSAGES
from weft.inference.inputs import PROMPT, prompt_list
from weft.inference.outputs import Logprob, RequestOutput
from weft.serve.async_engine import AsyncEngine, EngineDead, QueueFull
from weft.serve.messages import Conversation
from weft.serve.metrics import ServerMetrics
from weft.serve.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def refusal(e: ValueError | TypeError, prompt_field: str = PROMPT) -> APIError:
    """The engine's ValueError / TypeError for a request, as a 400 naming the field its check names (the
    prompt's field is `prompt_field`: a chat request's prompt is its messages)."""
    param = getattr(e, "param", None)
    return APIError(400, str(e), param=prompt_field if param == PROMPT else param)


def build_app(aengine: AsyncEngine, served_model_name: str) -> FastAPI:
    """The app over a started engine process; outputs flow while the app runs, and the engine process
    stops when the app shuts down (lifespan)."""
    metrics = ServerMetrics(aengine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.stop()

    app = FastAPI(title="weft", lifespan=lifespan)
    app.state.engine = aengine

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, str(e), e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg')}", "invalid_request_error")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                              "invalid_request_error", where or None)

    @app.exception_handler(EngineDead)
    async def _dead(request: Request, e: EngineDead) -> JSONResponse:
        return error_response(503, str(e), "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(500, f"{type(e).__name__}: {e}", "internal_server_error")

    @app.get("/health")
    async def health() -> Response:
        if aengine.running:
            return Response(status_code=200)
        return error_response(503, f"the engine process is not running: {aengine.dead}", "service_unavailable")

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=aengine.info.max_model_len)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def start(
        request: GenerationRequest, prompts: list[object], labels: list[str]
    ) -> tuple[str, list[AsyncIterator[RequestOutput]]]:
        """Checks that need no engine, then each prompt's stream (`labels` name them in errors): deltas when the
        client streams, else one final output each."""
        if request.model != served_model_name:
            raise APIError(404, f"The model `{request.model}` does not exist (this server serves "
                                f"`{served_model_name}`).", "NotFoundError", "model")
        bad = request.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad} is not supported by weft", param=bad)
        try:
            params = request.sampling_params()
        except (ValueError, TypeError) as e:
            raise refusal(e) from None
        rid = uuid.uuid4().hex
        zipped = enumerate(zip(prompts, labels, strict=True))
        return rid, [aengine.generate(f"{rid}-{i}", p, params, label) for i, (p, label) in zipped]

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        try:
            prompts = prompt_list(request.prompt)
        except (ValueError, TypeError) as e:
            raise refusal(e) from None
        if not prompts:
            raise APIError(400, "prompt is empty: send text, token ids, or a list of them", param="prompt")
        labels = ["prompt"] if len(prompts) == 1 else [f"prompt {i}" for i in range(len(prompts))]
        rid, streams = start(request, prompts, labels)
        firsts = await first_outputs(raw, streams)
        if request.stream:
            return sse(completion_chunks(f"cmpl-{rid}", request, streams, firsts, metrics))
        usage, k = Usage(), request.num_logprobs()
        choices = [CompletionChoice(index=i, text=out.outputs[0].text, finish_reason=out.outputs[0].finish_reason,
                                    stop_reason=out.outputs[0].stop_reason, logprobs=completion_logprobs([out], k),
                                    **token_fields(request, out))
                   for i, out in enumerate(await finished(streams, firsts, metrics, usage))]
        body = CompletionResponse(id=f"cmpl-{rid}", model=request.model, choices=choices, usage=usage.info())
        return JSONResponse(body.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        rid, streams = start(request, [Conversation(request.messages)], [MESSAGES])
        (first,) = await first_outputs(raw, streams, prompt_field=MESSAGES)
        if request.stream:
            return sse(chat_chunks(f"chatcmpl-{rid}", request, streams[0], first, metrics))
        usage = Usage()
        (out,) = await finished(streams, [first], metrics, usage)
        c = out.outputs[0]
        choice = ChatCompletionChoice(index=0, message=ChatMessage(role="assistant", content=c.text),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      logprobs=chat_logprobs([out], request.num_logprobs()),
                                      **token_fields(request, out))
        body = ChatCompletionResponse(id=f"chatcmpl-{rid}", model=request.model, choices=[choice], usage=usage.info())
        return JSONResponse(body.model_dump())

    return app


# ---- one HTTP request's streams ------------------------------------------------------------------


async def first_outputs(
    raw: Request, streams: list[AsyncIterator[RequestOutput]], prompt_field: str = PROMPT
) -> list[RequestOutput]:
    """Each stream's first output (a streaming request's first delta; else its one, final output). A refusal (or
    a full queue, a dead engine) closes them all and raises its HTTP error at once; so does a client that hangs
    up first, whose requests are aborted."""
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    gone = asyncio.ensure_future(disconnected(raw))
    try:
        waiting = set(firsts)
        while waiting:
            done, waiting = await asyncio.wait(waiting | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise APIError(499, "the client closed the connection")  # never reaches it; logged by the server
            waiting.discard(gone)
            problem = next((t.exception() for t in firsts if t in done and t.exception() is not None), None)
            if problem is not None:
                raise http_error(problem, prompt_field)
        return [t.result() for t in firsts]
    except BaseException:
        for t in firsts:
            t.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)  # each stream has left its wait (and aborted)
        await close(streams)
        raise
    finally:
        gone.cancel()


def http_error(problem: BaseException, prompt_field: str) -> BaseException:
    """What a stream's first output raised, as the HTTP error it answers."""
    if isinstance(problem, ValueError | TypeError):
        return refusal(problem, prompt_field)
    if isinstance(problem, QueueFull):
        return APIError(429, str(problem), "rate_limit_exceeded")
    if isinstance(problem, EngineDead):
        return APIError(503, str(problem), "service_unavailable")
    return problem


async def close(streams: list[AsyncIterator[RequestOutput]]) -> None:
    """Stop each stream: a request that has not finished is aborted and its blocks freed."""
    for s in streams:
        await s.aclose()


async def disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def merged(streams: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of all streams as they come."""
    if len(streams) == 1:
        yield 0, firsts[0]
        if not firsts[0].finished:
            async for out in streams[0]:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        queue.put_nowait((i, first))
        if not first.finished:
            async for out in stream:
                queue.put_nowait((i, out))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts, strict=True))]
    try:
        live = len(tasks)
        while live:
            i, out = await queue.get()
            yield i, out
            live -= out.finished
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no stream is still iterated when it is closed
        await close(streams)


def _token_text(token: int, entry: dict[int, Logprob]) -> str:
    text = entry[token].decoded_token
    return text if text is not None else f"token_id:{token}"  # a model without a tokenizer: vLLM's form


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k likeliest of a token's entries, likeliest first (the chosen token only if it is among them)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda e: e[1].rank)


def _positions(outs: list[RequestOutput]) -> list[tuple[int, dict[int, Logprob]]]:
    """(token, its logprobs) of every token the pieces carry."""
    return [(t, e) for o in outs for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=False)]


def completion_logprobs(outs: list[RequestOutput], k: int | None, offset: int = 0) -> CompletionLogprobs | None:
    """The legacy completions API's logprobs of the pieces' tokens (None unless asked); `offset`: where the
    pieces' text starts in the completion's."""
    if k is None:
        return None
    positions = _positions(outs)
    texts = [_token_text(t, e) for t, e in positions]
    starts = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return CompletionLogprobs(
        tokens=texts, token_logprobs=[e[t].logprob for t, e in positions], text_offset=starts,
        top_logprobs=[{_token_text(a, e): lp.logprob for a, lp in _ranked(e, k)} for _, e in positions],
    )  # fmt: skip


def chat_logprobs(outs: list[RequestOutput], k: int | None) -> ChatLogprobs | None:
    """The chat API's logprobs of the pieces' tokens (None unless asked)."""
    if k is None:
        return None

    def top(token: int, entry: dict[int, Logprob], lp: Logprob) -> dict:
        text = _token_text(token, entry)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return ChatLogprobs(content=[
        TokenLogprob(**top(t, e, e[t]), top_logprobs=[TopLogprob(**top(a, e, lp)) for a, lp in _ranked(e, k)])
        for t, e in _positions(outs)
    ])  # fmt: skip


async def finished(
    streams: list[AsyncIterator[RequestOutput]], outs: list[RequestOutput], metrics: ServerMetrics, usage: Usage
) -> list[RequestOutput]:
    """Finished requests' outputs (each whole, the last of its stream, which is closed now), counted in `usage`
    and the latency histograms."""
    await close(streams)
    for out in outs:
        metrics.finished(out)
        usage.add(out, len(out.outputs[0].token_ids))
    return outs


class Usage:
    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def add(self, out: RequestOutput, completion_tokens: int) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.completion += completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt, completion_tokens=self.completion,
                         total_tokens=self.prompt + self.completion)


def token_fields(request: GenerationRequest, out: RequestOutput) -> dict[str, list[int]]:
    """A finished choice's token ids and its prompt's, where the request asks for them (return_token_ids)."""
    if not request.return_token_ids:
        return {}
    return {"token_ids": out.outputs[0].token_ids, "prompt_token_ids": out.prompt_token_ids}


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def event(body: str) -> str:
    return f"data: {body}\n\n"


async def completion_chunks(
    rid: str, request: CompletionRequest, streams: list, firsts: list[RequestOutput], metrics: ServerMetrics
) -> AsyncIterator[str]:
    created, usage, k = int(time.time()), Usage(), request.num_logprobs()
    counts, offsets = [0] * len(streams), [0] * len(streams)
    try:
        async for i, out in merged(streams, firsts):
            c = out.outputs[0]
            counts[i] += len(c.token_ids)
            logprobs = completion_logprobs([out], k, offsets[i])
            offsets[i] += len(c.text)
            choice = CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      logprobs=logprobs, token_ids=c.token_ids if request.return_token_ids else None)
            yield event(CompletionResponse(id=rid, created=created, model=request.model, choices=[choice])
                        .model_dump_json(exclude_none=True))
            if out.finished:
                metrics.finished(out)
                usage.add(out, counts[i])
        if request.include_usage:
            yield event(CompletionResponse(id=rid, created=created, model=request.model, choices=[],
                                           usage=usage.info()).model_dump_json(exclude_none=True))
    except EngineDead as e:
        yield event(ErrorResponse(error=ErrorInfo(message=str(e), type="service_unavailable", code=503))
                    .model_dump_json(exclude_none=True))
    yield event("[DONE]")


async def chat_chunks(
    rid: str, request: ChatCompletionRequest, stream: AsyncIterator[RequestOutput], first: RequestOutput,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    created, count = int(time.time()), 0

    def chunk(delta: DeltaMessage, out: RequestOutput | None = None, usage: UsageInfo | None = None) -> str:
        choices = []
        if usage is None:
            c = out.outputs[0] if out is not None else None
            choices.append(ChatCompletionStreamChoice(
                index=0, delta=delta, finish_reason=c and c.finish_reason, stop_reason=c and c.stop_reason,
                logprobs=chat_logprobs([out], request.num_logprobs()) if out is not None else None,
                token_ids=c.token_ids if c is not None and request.return_token_ids else None,
            ))  # fmt: skip
        body = ChatCompletionStreamResponse(id=rid, created=created, model=request.model, choices=choices, usage=usage)
        return event(body.model_dump_json(exclude_none=True))

    try:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async for _, out in merged([stream], [first]):
            count += len(out.outputs[0].token_ids)
            yield chunk(DeltaMessage(content=out.outputs[0].text), out)
            if out.finished:
                metrics.finished(out)
                if request.include_usage:
                    usage = Usage()
                    usage.add(out, count)
                    yield chunk(DeltaMessage(), usage=usage.info())
    except EngineDead as e:
        yield event(ErrorResponse(error=ErrorInfo(message=str(e), type="service_unavailable", code=503))
                    .model_dump_json(exclude_none=True))
    yield event("[DONE]")

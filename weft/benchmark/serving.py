"""`weft bench serve`: an HTTP load generator for OpenAI-compatible servers, in vLLM's terms.

Requests (greedy, streamed) arrive at `request_rate` per second, with gamma-distributed gaps
(`burstiness` 1: Poisson; below 1 burstier; rate inf: all at once), at most `max_concurrency`
in flight. Everything is timed on the client: TTFT (send to the first chunk with a token), ITL
(between such chunks), TPOT ((E2E - TTFT) / (output tokens - 1)), E2E; goodput counts the
requests per second that meet every SLO given. Light to import: no torch.

Prompt formats: `token_ids` (vLLM's and weft's: the ids themselves, `ignore_eos`, usage and token
ids in the stream) or `words` ("t5 t17 ...": text that a word-level tokenizer of "t<id>" words
reads back as exactly those ids, for servers that take text only, such as `transformers serve`,
given a checkpoint saved with one by weft.benchmark.peer and no EOS to stop at).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from weft.benchmark.workloads import Request, uniform
from weft.utils import frozen_heap

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")  # --goodput keys, in ms
PROMPT_FORMATS = ("token_ids", "words")


def payload(model: str, request: Request, prompt_format: str) -> dict[str, object]:
    """The JSON body of one streamed, greedy completion in `prompt_format`."""
    body: dict[str, object] = {"model": model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True}
    if prompt_format == "words":
        return body | {"prompt": " ".join(f"t{t}" for t in request.prompt_token_ids)}
    return body | {
        "prompt": list(request.prompt_token_ids), "ignore_eos": True, "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }  # fmt: skip


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int = 0  # tokens the server reported (usage), 0 for a failed request
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2el_s is None or self.output_len < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request: 0 for the first, then gamma gaps of mean 1 / rate (all 0 at rate inf)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


async def send(
    session: aiohttp.ClientSession, url: str, model: str, request: Request, prompt_format: str = "token_ids"
) -> RequestRecord:
    """One streamed completion; the instant of each chunk that carries a token, taken as it arrives."""
    record = RequestRecord(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    events = 0
    try:
        async with session.post(url, json=payload(model, request, prompt_format)) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                body = line[6:].strip()
                if body == b"[DONE]":
                    break
                chunk = json.loads(body)
                now = time.perf_counter()
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or choice.get("token_ids"):
                    events += 1
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itls_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    record.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("error"):
                    record.error = chunk["error"].get("message", "error")
        record.output_len = record.output_len or events
        record.e2el_s = last - start
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record


async def run(
    base_url: str,
    model: str,
    requests: Sequence[Request],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    seed: int = 0,
    goodput: dict[str, float] | None = None,
    prompt_format: str = "token_ids",
) -> dict[str, object]:
    """Serve `requests` against `base_url` (…/v1); -> vLLM-style results (latencies in ms)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {prompt_format!r}: choose from {', '.join(PROMPT_FORMATS)}")
    url = base_url.rstrip("/") + "/completions"
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore bounds what is in flight
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def bounded(request: Request) -> RequestRecord:
            async with limit:
                return await send(session, url, model, request, prompt_format)

        if num_warmups:
            await asyncio.gather(*(bounded(requests[i % len(requests)]) for i in range(num_warmups)))
        with frozen_heap():  # while timed, a full collection walks only what the run made, not the caller's heap
            tasks = []
            start = time.perf_counter()
            for gap, request in zip(arrival_gaps(len(requests), request_rate, burstiness, seed), requests,
                                    strict=True):
                if gap:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.ensure_future(bounded(request)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return summarize(records, duration, request_rate, burstiness, max_concurrency, goodput or {})


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    ms = sorted(v * 1e3 for v in values_s)
    out: dict[str, float | None] = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        out[f"{'median' if q == 50 else f'p{q}'}_{name}_ms"] = _percentile(ms, q) if ms else None
    return out


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    goodput: dict[str, float],
) -> dict[str, object]:
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_len for r in done)
    good = [r for r in done if _meets(r, goodput)]
    return {
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (output_tokens + sum(r.prompt_len for r in done)) / duration_s,
        "goodput_slo_ms": goodput or None,
        "request_goodput": len(good) / duration_s if goodput else None,
        **_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
        **_stats("tpot", [r.tpot_s for r in done if r.tpot_s is not None]),
        **_stats("itl", [g for r in done for g in r.itls_s]),
        **_stats("e2el", [r.e2el_s for r in done if r.e2el_s is not None]),
    }


def _meets(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Every SLO met (a metric the request lacks, a one-token TPOT say, is not met)."""
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2el_s}
    return all(values[k] is not None and values[k] * 1e3 <= slo for k, slo in slos_ms.items())


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms); ValueError for anything else."""
    slos = {}
    for pair in pairs or []:
        key, _, value = pair.partition(":")
        if key not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes {'/'.join(SLO_METRICS)}:MS pairs, got {pair!r}")
        slos[key] = float(value)
    return slos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="(default: %(default)s)")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--num-prompts", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"),
                        help="prompt lengths, uniform in [MIN, MAX] (default: 100 1024)")
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"),
                        help="output lengths, uniform in [MIN, MAX] (default: 100 1024)")
    parser.add_argument("--vocab-size", type=int, default=1000, help="prompt ids are uniform below it (default: 1000)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default: inf)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no bound)")
    parser.add_argument("--num-warmups", type=int, default=0, help="requests sent and not timed first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="token_ids",
                        help="token_ids (default), or words for a server that takes text (see the module's docstring)")
    parser.add_argument("--result-file", help="write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        print(f"weft bench serve: {e}", file=sys.stderr)
        return 2
    workload = uniform(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.vocab_size, args.seed,
                       "bench-serve")
    result = asyncio.run(run(args.base_url, args.model, workload.requests, args.request_rate, args.burstiness,
                             args.max_concurrency, args.num_warmups, args.seed, slos, args.prompt_format))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    for key, value in result.items():
        shown = f"{value:,.2f}" if isinstance(value, float) else value
        print(f"{key:<28} {shown}")
    return 0 if result["failed"] == 0 else 1


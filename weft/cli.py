"""`weft`: the command line.

    weft check [--model M] [--max-tokens N] [--device cpu|cuda] [--dtype float32]
    weft serve MODEL [--attention A --scheduler S --block-size P ... --host H --port N --api-key K]
    weft bench serve --base-url URL --model NAME [--num-prompts N --request-rate R ...]

`check` is the token-exact gate against HuggingFace `generate`: one line per prompt per case,
exit status 1 on any mismatch. `serve` is the OpenAI-compatible server (weft.serve.api_server);
`bench serve` its load generator (weft.benchmark.serving). Bad arguments exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Mapping


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def api_key(text: str) -> str:
    if not text:  # `--api-key "$UNSET"` must not serve without a key
        raise argparse.ArgumentTypeError("must not be empty (leave it out to serve without a key)")
    return text


def string_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's --allowed-origins takes it: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return tuple(value)


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model name or local HF checkpoint directory (default: smollm2-135m-instruct)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per prompt, at most")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--deterministic", action="store_true",
                        help="the gate's cases with deterministic=True, then the determinism gate (weft.determinism)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The gate, here. torch and the engine are imported only now, so that --help answers at once."""
    import torch

    from weft.conformance import (
        TOP,
        conformance_prompts,
        deterministic_cases,
        hf_greedy,
        report_lines,
        run_case,
        standard_cases,
    )
    from weft.inference.config import EngineConfig
    from weft.models.loader import DEFAULT_MODEL, reference_model, resolve_model

    model = args.model or DEFAULT_MODEL
    try:
        config = EngineConfig(model=model, dtype=args.dtype, device=args.device)
        source = resolve_model(model)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    device, dtype = config.device, config.dtype
    logging.getLogger("weft").setLevel(logging.WARNING)  # each case's start-up lines would drown the verdicts
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    print(f"loading {model} ({dtype}, {device})...", flush=True)
    hf_model = reference_model(source, config.torch_dtype, device)
    prompts = conformance_prompts(source)
    # without a tokenizer (random weights) EOS means nothing: every prompt runs to --max-tokens
    ignore_eos = source.tokenizer is None
    decode = source.tokenizer.decode if source.tokenizer else (lambda ids: " ".join(map(str, ids)))
    # float32 is token-exact; 16-bit sums round by their order, so there vLLM's rule holds instead: at the
    # first difference each side's token is among the other's TOP likeliest
    top = 0 if dtype == "float32" else TOP
    rule = "token-exact" if not top else f"token-exact, or at the first difference within each other's top {top}"
    print(f"HF reference: {len(prompts)} prompts, greedy, up to {args.max_tokens} tokens ({rule})...", flush=True)

    def reference(ps: list[list[int]]) -> tuple[list[list[int]], list[list[set[int]]] | None]:
        return hf_greedy(hf_model, ps, args.max_tokens, ignore_eos, top)

    expected, expected_top = reference(prompts)
    failed = 0
    cases = deterministic_cases(device) if args.deterministic else standard_cases(device)
    for n, case in enumerate(cases, 1):
        print(f"[{case.label}] case {n} of {len(cases)}: serving {len(prompts)} prompts...", flush=True)
        result = run_case(
            model, case, prompts, expected, args.max_tokens, dtype, device, ignore_eos=ignore_eos,
            progress=sys.stderr.isatty(), reference=reference, expected_top=expected_top,
        )  # weft reads the weights itself, as a user's engine would; HF's model answers second turns
        for line in report_lines(result, decode):
            print(line, flush=True)
        if result.preemptions:
            print(f"[{case.label}] {result.preemptions} preemptions", flush=True)
        failed += not result.ok
    verdict = "all OK" if not failed else f"{failed} of {len(cases)} cases FAILED"
    print(f"{verdict} ({len(cases)} cases x {len(prompts)} prompts, {time.perf_counter() - started:.0f} s)")
    if args.deterministic:
        failed += _determinism_gate(model, source.config, config, args.max_tokens)
    return 1 if failed else 0


def _determinism_gate(model: str, shape, config, max_tokens: int) -> int:
    """weft.determinism's gate on GATE_PROMPTS prompts -> the number of scenarios that failed (each printed)."""
    from weft.determinism import GATE_LENGTHS, GATE_PROMPTS, determinism_prompts, run_gate

    longest = min(GATE_LENGTHS[1], shape.max_model_len - max_tokens)
    prompts = determinism_prompts(shape.V, GATE_PROMPTS, (min(GATE_LENGTHS[0], longest), longest))
    options = dict(dtype=config.dtype, device=config.device, deterministic=True,
                   attention="triton" if config.device.type == "cuda" else "paged")
    print(f"determinism gate: {len(prompts)} prompts of {GATE_LENGTHS[0]}-{longest} tokens, half greedy, half "
          f"seeded, {max_tokens} tokens each, alone and then...", flush=True)

    def report(r) -> None:
        verdict = "OK" if r.ok else f"FAIL ({r.first_difference})"
        print(f"[{r.label}] {r.identical} of {r.total} bitwise identical to alone, {r.preemptions} preemptions: "
              f"{verdict}", flush=True)

    failed = sum(not r.ok for r in run_gate(model, options, prompts, max_tokens, report=report))
    print("determinism: all OK" if not failed else f"determinism: {failed} scenarios FAILED")
    return failed


def engine_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields but the model: `weft serve`'s engine options, one --field-name each."""
    from weft.inference.config import EngineConfig

    return [f for f in dataclasses.fields(EngineConfig) if f.name != "model"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(f: dataclasses.Field) -> bool:
    return "bool" in f.type  # a str: config.py's annotations are postponed


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One --option per EngineConfig field (but the model), typed as the field is; None: its default."""
    for f in engine_fields():
        flag = _flag(f.name)
        if _is_bool(f):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=f"(default: {f.default})")
            continue
        kind = float if "float" in f.type else int if "int" in f.type else str
        parser.add_argument(flag, type=kind, help=f"(default: {f.default})")


def engine_flags(options: Mapping[str, object]) -> list[str]:
    """The `weft serve` flags that set EngineConfig `options` (by field name): ["--block-size", "16",
    "--no-enable-overlap", ...]. None is left out (the default); a torch.dtype or torch.device goes as its name."""
    import torch

    fields = {f.name: f for f in engine_fields()}
    unknown = [name for name in options if name not in fields]
    if unknown:
        raise ValueError(f"not `weft serve` engine options: {', '.join(map(str, unknown))}")
    flags = []
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool) != _is_bool(fields[name]):
            raise TypeError(f"{name} is {fields[name].type}, got {value!r}")
        if isinstance(value, bool):
            flags.append(_flag(name if value else "no_" + name))
        else:
            flags += [_flag(name), str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)]
    return flags


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Build the engine, then serve it with uvicorn until interrupted."""
    import uvicorn

    from weft.inference.config import EngineConfig
    from weft.serve.api_server import MAX_REQUEST_BODY_BYTES, Cors, build_app
    from weft.serve.async_engine import AsyncEngine
    from weft.utils import freeze_heap

    options = {f.name: getattr(args, f.name) for f in engine_fields()}
    try:
        config = EngineConfig(model=args.model, **{k: v for k, v in options.items() if v is not None})
        engine = AsyncEngine(config, args.max_queued_requests)  # the engine is built in its own process
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    cors = Cors(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    app = build_app(engine, args.served_model_name or str(args.model), api_key=args.api_key,
                    max_request_body_bytes=args.max_request_body_bytes or MAX_REQUEST_BODY_BYTES, cors=cors)
    print(f"weft: serving {args.model} at http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    freeze_heap()  # this process's (the app's, the tokenizer's, torch's), as the engine's process freezes its own
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gate = commands.add_parser("check", help="the token-exact check against HF generate")
    add_check_arguments(gate)
    gate.set_defaults(run=check, parser=gate)

    server = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions)")
    server.add_argument("model", help="model name or local HF checkpoint directory")
    add_engine_arguments(server)
    server.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    server.add_argument("--served-model-name", help="the name clients use (default: MODEL as given)")
    server.add_argument("--max-queued-requests", type=positive_int,
                        help="waiting requests beyond which new ones get 429 (default: no bound)")
    server.add_argument("--api-key", type=api_key, default=os.environ.get("WEFT_API_KEY") or None,
                        help="clients must send `Authorization: Bearer KEY` to /v1/..., /tokenize and /detokenize "
                             "(default: $WEFT_API_KEY; unset: no key)")
    server.add_argument("--max-request-body-bytes", type=positive_int,
                        help="larger request bodies get 400, unread (default: 16 MiB)")
    for what in ("origins", "methods", "headers"):  # CORS: what a web page's scripts may send, as vLLM's flags
        server.add_argument(f"--allowed-{what}", type=string_list, default=("*",),
                            help=f'CORS: allowed {what}, a JSON list (default: ["*"])')
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    server.set_defaults(run=serve, parser=server)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from weft.benchmark.serving import add_arguments  # light: no torch
    from weft.benchmark.serving import main as bench_serve

    client = bench.add_parser("serve", help="load an OpenAI-compatible server and report its latencies")
    add_arguments(client)
    client.set_defaults(run=lambda parser, args: bench_serve(args), parser=client)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args.parser, args)


if __name__ == "__main__":
    sys.exit(main())

"""`weft`: the command line. `weft check` is the token-exact gate against HuggingFace `generate`.

    weft check [--model M] [--max-tokens N] [--device cpu|cuda] [--dtype float32]

Prints one line per prompt per case and exits 1 on any mismatch (2 on bad arguments).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model name or local HF checkpoint directory (default: smollm2-135m-instruct)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="new tokens per prompt, at most")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The gate, here. torch and the engine are imported only now, so that --help answers at once."""
    import torch

    from weft.conformance import conformance_prompts, hf_reference, report_lines, run_case, standard_cases
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
    print(f"HF reference: {len(prompts)} prompts, greedy, up to {args.max_tokens} tokens...", flush=True)
    expected = hf_reference(hf_model, prompts, args.max_tokens, ignore_eos)
    del hf_model  # weft reads the weights itself, as a user's engine would
    failed = 0
    cases = standard_cases(device)
    for n, case in enumerate(cases, 1):
        print(f"[{case.label}] case {n} of {len(cases)}: serving {len(prompts)} prompts...", flush=True)
        result = run_case(
            model, case, prompts, expected, args.max_tokens, dtype, device, ignore_eos=ignore_eos,
            progress=sys.stderr.isatty(),
        )
        for line in report_lines(result, decode):
            print(line, flush=True)
        if result.preemptions:
            print(f"[{case.label}] {result.preemptions} preemptions", flush=True)
        failed += not result.ok
    verdict = "all OK" if not failed else f"{failed} of {len(cases)} cases FAILED"
    print(f"{verdict} ({len(cases)} cases x {len(prompts)} prompts, {time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gate = commands.add_parser("check", help="the token-exact check against HF generate")
    add_check_arguments(gate)
    gate.set_defaults(run=check, parser=gate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args.parser, args)


if __name__ == "__main__":
    sys.exit(main())

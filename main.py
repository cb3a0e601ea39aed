"""weft's token-exact check against HuggingFace `generate` (see weft/conformance.py).

    uv run main.py [--model M] [--max-tokens N] [--device cpu|cuda] [--dtype float32]
    uv run main.py --modal [--modal-gpu H100] [--model M] [--max-tokens N] [--dtype D]
    uv run main.py --collect all|e1 e4 ... [--modal-gpu H100]

Prints one line per prompt per case and exits 1 on any mismatch. --modal runs the check on a
Modal GPU and prints its lines here; --collect runs perf experiments on Modal GPUs, a GPU per
case, and stores their results under results/ as a local run would.
"""

from __future__ import annotations

import argparse
import sys
import time

from weft.remote import cli as remote
from weft.remote.preflight import DEFAULT_GPU, ModalUnavailable, preflight


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model name or local HF checkpoint directory (default: smollm2-135m-instruct)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--modal", action="store_true", help="run the check on a Modal GPU")
    where.add_argument(
        "--collect", nargs="+", metavar="EXPERIMENT", choices=["all", *remote.experiments()],
        help="run perf experiments on Modal GPUs (all, or some of e1 e2 ...); results go to results/",
    )  # fmt: skip
    parser.add_argument("--modal-gpu", default=DEFAULT_GPU, help="Modal GPU type (default: %(default)s)")
    return parser


def gate_argv(args: argparse.Namespace) -> list[str]:
    """The check's options for main.py on the Modal GPU; its device is whatever it has there."""
    argv = ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
    for flag, value in (("--model", args.model), ("--device", args.device)):
        if value is not None:
            argv += [flag, value]
    return argv


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The check, here. torch and the engine are imported only now: --modal starts in a second."""
    import torch

    from weft.conformance import conformance_prompts, hf_reference, report_lines, run_case, standard_cases
    from weft.inference.llm import DTYPES
    from weft.models.loader import DEFAULT_MODEL, load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype not in DTYPES:
        parser.error(f"argument --dtype: invalid choice: {args.dtype!r} (choose from {', '.join(DTYPES)})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    model = args.model or DEFAULT_MODEL
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    print(f"loading {model} ({args.dtype}, {device})...", flush=True)
    loaded = load_model(model, DTYPES[args.dtype], torch.device(device))
    prompts = conformance_prompts(loaded)
    # without a tokenizer (random weights) EOS means nothing: every prompt runs to --max-tokens
    ignore_eos = loaded.tokenizer is None
    decode = loaded.tokenizer.decode if loaded.tokenizer else (lambda ids: " ".join(map(str, ids)))
    print(f"HF reference: {len(prompts)} prompts, greedy, up to {args.max_tokens} tokens...", flush=True)
    expected = hf_reference(loaded.hf_model, prompts, args.max_tokens, ignore_eos)
    failed = 0
    cases = standard_cases(device)
    for case in cases:
        result = run_case(
            loaded.hf_model, case, prompts, expected, args.max_tokens, args.dtype, device, ignore_eos=ignore_eos
        )
        for line in report_lines(result, decode):
            print(line, flush=True)
        if result.preemptions:
            print(f"[{case.label}] {result.preemptions} preemptions", flush=True)
        failed += not result.ok
    verdict = "all OK" if not failed else f"{failed} of {len(cases)} cases FAILED"
    print(f"{verdict} ({len(cases)} cases x {len(prompts)} prompts, {time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if not (args.modal or args.collect):
        return check(parser, args)
    try:
        gpu = preflight(args.modal_gpu)
    except ModalUnavailable as e:
        print(f"modal: {e}", file=sys.stderr)
        return 1
    return remote.collect(args.collect, gpu) if args.collect else remote.gate(gate_argv(args), gpu)


if __name__ == "__main__":
    sys.exit(main())

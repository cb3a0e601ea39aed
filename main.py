"""weft's token-exact check against HuggingFace `generate` (see weft/conformance.py), as `weft check`.

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

from weft.cli import add_check_arguments, check
from weft.remote import cli as remote
from weft.remote.preflight import DEFAULT_GPU, ModalUnavailable, preflight


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_check_arguments(parser)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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

"""weft's token-exact check against HuggingFace `generate` (see weft/conformance.py).

    uv run main.py [--model M] [--max-tokens N] [--device cpu|cuda] [--dtype float32]

Prints one line per prompt per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from weft.conformance import conformance_prompts, hf_reference, report_lines, run_case, standard_cases
from weft.inference.llm import DTYPES
from weft.models.loader import DEFAULT_MODEL, load_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name or local HF checkpoint directory")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    started = time.perf_counter()
    print(f"loading {args.model} ({args.dtype}, {args.device})...", flush=True)
    loaded = load_model(args.model, DTYPES[args.dtype], torch.device(args.device))
    prompts = conformance_prompts(loaded)
    # without a tokenizer (random weights) EOS means nothing: every prompt runs to --max-tokens
    ignore_eos = loaded.tokenizer is None
    decode = loaded.tokenizer.decode if loaded.tokenizer else (lambda ids: " ".join(map(str, ids)))
    print(f"HF reference: {len(prompts)} prompts, greedy, up to {args.max_tokens} tokens...", flush=True)
    expected = hf_reference(loaded.hf_model, prompts, args.max_tokens, ignore_eos)
    failed = 0
    cases = standard_cases(args.device)
    for case in cases:
        result = run_case(
            loaded.hf_model, case, prompts, expected, args.max_tokens, args.dtype, args.device, ignore_eos=ignore_eos
        )
        for line in report_lines(result, decode):
            print(line, flush=True)
        if result.preemptions:
            print(f"[{case.label}] {result.preemptions} preemptions", flush=True)
        failed += not result.ok
    verdict = "all OK" if not failed else f"{failed} of {len(cases)} cases FAILED"
    print(f"{verdict} ({len(cases)} cases x {len(prompts)} prompts, {time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

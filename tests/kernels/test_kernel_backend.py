"""TritonBackend end to end (prepare, write, attend) and its refusal of bad inputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels.paged_case import PagedCase, assert_matches, make_case, reference
from weft.attention import get_backend
from weft.attention.kernels.decode import MAX_SHARED_SPLITS
from weft.attention.kernels.tiles import MAX_HEAD_DIM
from weft.attention.triton import TritonBackend
from weft.config import ModelConfig

pytestmark = pytest.mark.kernels
LAYER = 1  # of L = 2: the other layer must not be read


def model_config(H_q: int, H_kv: int, D: int) -> ModelConfig:
    return ModelConfig(
        arch="llama", V=32, E=H_q * D, L=2, H_q=H_q, H_kv=H_kv, D=D, intermediate=32, rms_eps=1e-6,
        rope_theta=1e4, max_model_len=1 << 16, tie_word_embeddings=False,
    )


def backend_for(case: PagedCase) -> tuple[TritonBackend, torch.Tensor, torch.Tensor]:
    """A backend whose layer LAYER holds the case's context, less the new tokens: those are
    returned as k/v [T_total, H_kv, D] for `forward` to write. Everything else is NaN."""
    N, P, H_kv, D = case.k_cache.shape
    backend = get_backend("triton")(model_config(case.q.shape[1], H_kv, D), N, P, case.q.dtype, case.q.device)
    backend.check_steps = True  # every step checked, as WEFT_CHECK_STEPS=1 asks
    backend.kv_cache.fill_(float("nan"))
    slots = case.slot_mapping
    k_new, v_new = (c.flatten(0, 1)[slots].clone() for c in (case.k_cache, case.v_cache))
    for i, cache in enumerate((case.k_cache, case.v_cache)):
        backend.kv_cache[i, LAYER] = cache
        backend.kv_cache[i, LAYER].flatten(0, 1)[slots] = float("nan")
    return backend, k_new, v_new


def run_step(case: PagedCase, batch_invariant: bool = False) -> torch.Tensor:
    """One step's forward; `batch_invariant` (EngineConfig.deterministic): decodes too in the grouped kernel, the
    step's other requests as prompt tokens."""
    backend, k, v = backend_for(case)
    backend.batch_invariant = batch_invariant
    meta = case.meta()
    if batch_invariant:
        prompt = case.query_start_loc.diff() * (torch.arange(meta.num_requests) >= meta.num_decodes).to(case.q.device)
        meta = replace(meta, prompt_tokens=prompt.to(torch.int32), num_prompt_tokens=int(prompt.sum()))
    step = backend.prepare(meta)
    assert (step.splits is not None) == (step.meta.num_decodes > 0 and not batch_invariant)
    assert batch_invariant == (step.roles is not None)
    return backend.forward(LAYER, case.q, k, v, step)


DECODE = ([1, 1, 1], [1, 90, 33])
MIXED = ([1, 1, 30, 4, 1], [50, 9, 30, 4, 40])  # two decodes, then prefills, one of them a single token


@pytest.mark.parametrize(
    ("D", "q_lens", "context_lens"),
    [(64, *DECODE), (64, *MIXED), (48, *MIXED), (80, *MIXED), (96, *MIXED)],
    ids=["decode", "mixed", "mixed-D48", "mixed-D80", "mixed-D96"],
)
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
def test_forward_fp32(device, D, q_lens, context_lens, batch_invariant):
    case = make_case(4, 2, D, 16, q_lens, context_lens, torch.float32, device, 3)
    assert_matches(run_step(case, batch_invariant), reference(case, D**-0.5))


GPU_DECODE = ([1] * 8, [1, 5000, 300, 2048, 77, 4096, 1, 999])
GPU_MIXED = ([1, 1000, 1, 257], [3000, 1000, 17, 2000])


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("D", "dtype", "q_lens", "context_lens"),
    [(128, torch.bfloat16, *GPU_DECODE), (128, torch.bfloat16, *GPU_MIXED)]
    + [(d, torch.bfloat16, *GPU_MIXED) for d in (48, 80, 96, 256)]
    + [(80, torch.float16, *GPU_DECODE), (96, torch.float16, *GPU_MIXED)],
    ids=["decode", "mixed", "mixed-D48", "mixed-D80", "mixed-D96", "mixed-D256", "decode-D80-fp16", "mixed-D96-fp16"],
)
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
def test_forward_gpu(device, D, dtype, q_lens, context_lens, batch_invariant):
    case = make_case(16, 8, D, 16, q_lens, context_lens, dtype, device, 4)
    assert_matches(run_step(case, batch_invariant), reference(case, D**-0.5))


@pytest.fixture
def bad_case(device) -> PagedCase:
    return make_case(4, 2, 64, 8, [1, 3], [10, 20], torch.float32, device, 5)


@pytest.mark.parametrize("D", [1, 40, 80, 96, 256])
def test_accepts_head_dims_up_to_max(device, D):
    """Any D up to MAX_HEAD_DIM, a power of two or not: the kernels pad it."""
    backend = TritonBackend(model_config(4, 2, D), 4, 8, torch.float32, device)
    assert backend.kv_cache.shape[-1] == D


@pytest.mark.parametrize("D", [0, MAX_HEAD_DIM + 1, 512])
def test_rejects_head_dim_outside_range(device, D):
    limit = rf"head dimension D must be in \[1, {MAX_HEAD_DIM}\], got {D}"
    with pytest.raises(ValueError, match=limit):
        TritonBackend.check_model(model_config(4, 2, D))
    with pytest.raises(ValueError, match=limit):
        TritonBackend(model_config(4, 2, D), 4, 8, torch.float32, device)


@pytest.mark.parametrize(
    "which",
    ["q heads", "k heads", "v head dim", "q dtype", "k tokens"],
)
def test_rejects_mismatched_tokens(bad_case, which):
    backend, k, v = backend_for(bad_case)
    q = bad_case.q
    if which == "q heads":
        q = q[:, :2]
    elif which == "k heads":
        k = k.repeat(1, 2, 1)
    elif which == "v head dim":
        v = v[..., :32]
    elif which == "q dtype":
        q = q.double()
    else:
        k = k[:-1]
    step = backend.prepare(bad_case.meta())
    with pytest.raises(ValueError, match="the cache needs"):
        backend.forward(LAYER, q, k, v, step)


@pytest.mark.parametrize("entry", [-1, "N"])
def test_rejects_block_table_entry_out_of_range(bad_case, entry):
    backend, _, _ = backend_for(bad_case)
    table = bad_case.block_tables.clone()
    table[1, 0] = backend.num_blocks if entry == "N" else entry
    with pytest.raises(ValueError, match="block table entry"):
        backend.prepare(replace(bad_case.meta(), block_tables=table))


def test_rejects_context_beyond_block_table(bad_case):
    backend, _, _ = backend_for(bad_case)
    meta = bad_case.meta()
    too_long = meta.block_tables.shape[1] * backend.block_size + 1
    context_lens = meta.context_lens.clone()
    context_lens[0] = too_long
    with pytest.raises(ValueError, match="needs .* blocks"):
        backend.prepare(replace(meta, context_lens=context_lens, max_context_len=too_long))


def test_rejects_context_lens_past_max_context_len(bad_case):
    backend, _, _ = backend_for(bad_case)
    meta = bad_case.meta()
    with pytest.raises(ValueError, match="max_context_len"):
        backend.prepare(replace(meta, context_lens=meta.context_lens + 1))


def test_rejects_more_new_tokens_than_context(bad_case):
    backend, _, _ = backend_for(bad_case)
    meta = bad_case.meta()
    with pytest.raises(ValueError, match="new tokens"):
        backend.prepare(replace(meta, context_lens=meta.context_lens.clamp(max=2), max_context_len=2))


@pytest.mark.parametrize("num_decodes", [2, -1, 3])
def test_rejects_num_decodes_that_do_not_match(bad_case, num_decodes):
    """bad_case has one decode, then a request with three new tokens."""
    backend, _, _ = backend_for(bad_case)
    with pytest.raises(ValueError, match="num_decodes"):
        backend.prepare(replace(bad_case.meta(), num_decodes=num_decodes))


def test_rejects_slot_out_of_range(bad_case):
    backend, _, _ = backend_for(bad_case)
    meta = bad_case.meta()
    slots = meta.slot_mapping.clone()
    slots[-1] = backend.num_blocks * backend.block_size
    with pytest.raises(ValueError, match="slot"):
        backend.prepare(replace(meta, slot_mapping=slots))


def test_steps_are_checked_only_when_asked(bad_case, monkeypatch):
    backend, _, _ = backend_for(bad_case)
    calls = []
    monkeypatch.setattr(backend, "check", lambda meta: calls.append(meta))
    backend.prepare(bad_case.meta())
    backend.check_steps = False  # the default: no host sync in the hot path
    backend.prepare(bad_case.meta())
    assert len(calls) == 1


def grouped_case(dtype: torch.dtype, device) -> tuple[PagedCase, list[int]]:
    """Three decodes whose tables begin with the same 8 blocks (128 tokens), a decode of its own, a prefill; and the
    groups the backend finds in them."""
    case = make_case(4, 2, 64, 16, [1, 1, 1, 1, 30], [150, 200, 170, 90, 40], dtype, device, 7)
    case.block_tables[1:3, :8] = case.block_tables[0, :8]
    backend, _, _ = backend_for(case)
    decodes = case.meta().num_decodes
    return case, backend.prefix_groups(case.block_tables[:decodes].tolist(), case.context_lens[:decodes].tolist())


def with_groups(case: PagedCase, groups: list[int], shared_lens: list[int]):
    device = case.q.device
    return replace(case.meta(), decode_groups=torch.tensor(groups, dtype=torch.int32, device=device).view(-1, 3),
                   shared_lens=torch.tensor(shared_lens, dtype=torch.int32, device=device))


def test_forward_with_decode_groups_fp32(device):
    """A mixed step whose decodes the backend groups: checked, then the same outputs as the reference."""
    case, groups = grouped_case(torch.float32, device)
    assert groups == [0, 3, 128]
    backend, k, v = backend_for(case)
    step = backend.prepare(with_groups(case, groups, [128, 128, 128, 0, 0]))
    assert step.shared is not None
    assert_matches(backend.forward(LAYER, case.q, k, v, step), reference(case, 64**-0.5))


def test_groups_too_few_to_fill_half_the_gpu_are_not_formed(device):
    """A step's groups whose shared-kernel programs would fill under half of the GPU's slots go ungrouped; in
    deterministic mode no decodes are grouped."""
    case, _ = grouped_case(torch.float32, device)
    backend, _, _ = backend_for(case)
    tables, lens = case.block_tables[:4].tolist(), case.context_lens[:4].tolist()
    for slots, expected in ((2 * 1 * 2 * MAX_SHARED_SPLITS, [0, 3, 128]), (2 * 1 * 2 * MAX_SHARED_SPLITS + 1, [])):
        backend.__dict__["_slots"] = slots  # one group, H_kv = 2
        assert backend.prefix_groups(tables, lens) == expected
    backend.batch_invariant = True  # EngineConfig.deterministic: a group would follow the batch
    assert backend.prefix_groups(tables, lens) == [] and not backend.shares_prefixes


@pytest.mark.parametrize(("groups", "shared_lens", "match"), [
    ([0, 3, 128], [128, 128, 0, 0, 0], "shared_lens"),
    ([0, 3, 100], [100, 100, 100, 0, 0], "whole tiles"),
    ([0, 4, 128], [128, 128, 128, 128, 0], "do not all share"),
    ([3, 2, 64], [0, 0, 0, 64, 64], "2 or more of the 4 decodes"),
    ([0, 1, 128], [128, 0, 0, 0, 0], "2 or more"),
    ([0, 3, 64, 1, 2, 128], [64, 128, 128, 0, 0], "overlaps"),
    ([1, 2, 128, 0, 2, 128], [128, 128, 128, 0, 0], "out of order"),
])  # fmt: skip
def test_rejects_groups_that_do_not_share(device, groups, shared_lens, match):
    case, _ = grouped_case(torch.float32, device)
    backend, _, _ = backend_for(case)
    with pytest.raises(ValueError, match=match):
        backend.prepare(with_groups(case, groups, shared_lens))

"""The fused MoE kernels (weft/layers/moe.py) against a float64 reference written from the definition, the pairs'
grouping by expert, the routing kernels against PyTorch's softmax and top-k, and weft's SparseMoE against HF's
Qwen3MoeSparseMoeBlock."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from weft.config import MoEConfig
from weft.layers import fused
from weft.layers.moe import (
    SparseMoE,
    experts_reference,
    fused_experts,
    group_pairs,
    pair_experts,
    route_kernel,
    router_kernel,
    runs_pairs,
)

pytestmark = pytest.mark.kernels

CPU_DTYPES = [torch.float32]  # the interpreter computes 16-bit types wrongly
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float32, torch.bfloat16)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to each row's scale


def routed(T: int, N: int, k: int, E: int, I_e: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g)
    gate_up = torch.randn(N, 2 * I_e, E, generator=g) / E**0.5
    down = torch.randn(N, E, I_e, generator=g) / I_e**0.5
    ids = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(T)])  # k distinct experts per token
    weights = torch.rand(T, k, generator=g)
    return [t.to(device) if t.dtype == torch.int64 else t.to(dtype).to(device) for t in (x, gate_up, down, weights,
                                                                                              ids)]


def definition(x, gate_up, down, weights, ids) -> torch.Tensor:
    """Each pair's weighted expert output [T * k, E] in float64, token by token."""
    I_e = down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = gate_up[e].double() @ x[t].double()
            rows.append(down[e].double() @ (F.silu(h[:I_e]) * h[I_e:]) * weights[t, j].double())
    return torch.stack(rows)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    got, want = got.double().cpu(), want.cpu()
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-3)
    return bool(((got - want) / scale).abs().max() <= TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
# E and I_e off the 64-wide tiles; T * k pairs below and above the 16-row blocks, an expert with none
@pytest.mark.parametrize(("T", "N", "k", "E", "I_e"), [(1, 4, 2, 64, 32), (5, 8, 2, 48, 40), (37, 8, 3, 80, 24)])
def test_fused_experts_match_the_definition(device, dtype, T, N, k, E, I_e):
    args = routed(T, N, k, E, I_e, dtype, device, seed=T)
    want = definition(*args)
    got = fused_experts(*args)
    assert got.dtype == dtype and got.shape == (T * k, E)
    assert close(got, want, dtype)
    assert close(experts_reference(*args), want, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
# E and I_e off the pair kernels' column blocks and K steps; one pair and as many as they take
@pytest.mark.parametrize(("T", "N", "k", "E", "I_e"), [(1, 4, 1, 300, 40), (1, 128, 8, 64, 24), (2, 8, 8, 48, 264)])
def test_pair_experts_sum_each_tokens_pairs(device, dtype, T, N, k, E, I_e):
    assert runs_pairs(T, k, E)
    args = routed(T, N, k, E, I_e, dtype, device, seed=T + k)
    want = definition(*args).view(T, k, E).sum(1)
    got = pair_experts(*args)
    assert got.dtype == dtype and got.shape == (T, E)
    assert close(got, want, dtype)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("T", "N", "k"), [(1, 128, 8), (5, 60, 3), (3, 8, 1)])
def test_route_kernel_is_softmax_top_k(device, norm, T, N, k):
    g = torch.Generator().manual_seed(N)
    logits = torch.randn(T, N, generator=g).to(device)
    logits[0, 1] = logits[0, 2] = logits[0].max() + 1  # equal logits: the lower id first
    weights, ids = route_kernel(logits, k, norm)
    probs = F.softmax(logits.double(), dim=-1)
    want_weights, want_ids = probs.topk(k, dim=-1)
    if norm:
        want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    assert ids[0, :2].tolist() == [1, 2][:k]  # torch.topk may order the tie either way
    assert ids[0, 2:].tolist() == want_ids[0, 2:].tolist() and ids[1:].tolist() == want_ids[1:].tolist()
    assert torch.allclose(weights.double(), want_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES + GPU_DTYPES)
@pytest.mark.parametrize(("T", "N", "k", "E"), [(1, 128, 8, 300), (2, 60, 3, 48), (2, 8, 1, 2048)])
def test_router_kernel_is_the_matmul_then_the_routing(device, dtype, T, N, k, E):
    """The router's matmul and routing in one launch, against the definition in float64: its experts have the top_k
    logits in order (up to the dtype's rounding of a logit: the kernel rounds them as the router's Linear does),
    their weights are their renormalised softmax probabilities. Run twice: the arrival counters are back at 0."""
    g = torch.Generator().manual_seed(E)
    x, w = torch.randn(T, E, generator=g).to(dtype), (torch.randn(N, E, generator=g) / E**0.5).to(dtype)
    logits = x.double() @ w.double().T  # [T, N]
    best = logits.topk(k, dim=-1).values
    for _ in range(2):
        weights, ids = router_kernel(x.to(device), w.to(device), k, True)
        ids = ids.cpu()
        assert weights.dtype == dtype and all(len(set(row)) == k for row in ids.tolist())
        assert torch.allclose(logits.gather(1, ids), best, rtol=0, atol=TOL[dtype] * best.abs().max())
        probs = F.softmax(logits, dim=-1).gather(1, ids)
        assert torch.allclose(weights.double().cpu(), probs / probs.sum(-1, keepdim=True), rtol=TOL[dtype], atol=0)


# pairs within one of the grouping kernel's tiles and across many, in one chunk (GROUP_CHUNK) and in ten; experts
# fewer than a power of two, and 128
@pytest.mark.parametrize(("T", "N", "k", "M"), [(37, 8, 3, 16), (300, 128, 8, 16), (70, 60, 4, 64)])
def test_pairs_are_grouped_by_expert_in_padded_blocks(device, T, N, k, M):
    *_, ids = routed(T, N, k, 16, 16, torch.float32, device)
    ids[:, 0] = 2  # a crowded expert, more than one block of pairs
    pairs, block_expert = group_pairs(ids, N, M)
    P = T * k
    assert pairs.numel() == block_expert.numel() * M == (-(-P // M) + N) * M
    real = pairs[pairs < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair once
    flat = ids.flatten()
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * M : (b + 1) * M]
        if e == N:
            assert (block == P).all()  # past the last group
        else:
            assert (flat[block[block < P]] == e).all() and (block < P).any()
    for e in range(N):  # each group in pair order
        group = pairs[(flat[pairs.clamp_max(P - 1)] == e) & (pairs < P)]
        assert (group[1:] > group[:-1]).all() and group.numel() == (flat == e).sum()
    assert (block_expert[:-1] <= block_expert[1:]).all()


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["renormalised", "as-routed"])
@pytest.mark.parametrize("tokens", [1, 11])  # few pairs (`pair_experts`) and pairs grouped by expert
def test_sparse_moe_is_hfs_block(monkeypatch, device, tokens, norm_topk_prob):
    """Routing (softmax, top-k, renormalised or not as the config says) and the experts, in PyTorch ops (on the CPU)
    and through the kernels (on the CPU in the interpreter), against HF's block with the same weights, in float32."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model("qwen3_moe", hidden_size=48, moe_intermediate_size=24, num_experts=8,
                                  num_experts_per_tok=3, norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeSparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ours = SparseMoE(48, MoEConfig(8, 3, 24, norm_topk_prob, (0,)))
    ours.load_state_dict(hf.state_dict())  # the same names: gate.weight, experts.gate_up_proj, experts.down_proj
    x = torch.randn(2, tokens, 48, generator=g).to(device)
    hf, ours = hf.to(device), ours.to(device)
    want = hf(x).view(2 * tokens, 48)
    assert torch.allclose(ours(x.view(2 * tokens, 48)), want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(fused, "on_kernels", lambda t: True)
    # the kernels sum in another order than HF's matmuls: float32's rounding, up to a few 1e-6 on outputs of ~5
    assert torch.allclose(ours(x.view(2 * tokens, 48)), want, rtol=1e-5, atol=1e-5)

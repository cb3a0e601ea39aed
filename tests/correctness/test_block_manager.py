"""The block manager's prefix cache: shared full blocks, reference counts, and least-recently-freed eviction."""

from __future__ import annotations

import pytest
import torch

from weft import LLM, SamplingParams
from weft.inference.block_manager import BlockManager
from weft.inference.outputs import RequestMetrics
from weft.inference.sequence import Sequence

pytestmark = pytest.mark.correctness
P = 4


def seq(tokens: list[int], **params) -> Sequence:
    return Sequence("s", list(tokens), len(tokens), SamplingParams(**params), len(tokens) + 4, RequestMetrics(0.0))


def computed(blocks: BlockManager, s: Sequence) -> Sequence:
    """Admit `s` as a scheduler does and mark its prompt computed (its blocks registered)."""
    prefix = blocks.cached_prefix(s)
    assert blocks.can_hold(s, s.num_tokens, prefix)
    blocks.take_prefix(s, prefix)
    blocks.grow(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    blocks.commit(s)
    return s


def test_requests_that_begin_alike_share_their_full_blocks():
    blocks = BlockManager(16, P, prefix_caching=True)
    a = computed(blocks, seq(list(range(10))))  # blocks: [0..3] [4..7] [8 9]
    b = seq(list(range(8)) + [50, 51, 52])
    prefix = blocks.cached_prefix(b)
    assert prefix == a.block_table[:2]
    blocks.take_prefix(b, prefix)
    assert b.num_computed_tokens == 8 and [blocks.refs[x] for x in prefix] == [2, 2]
    blocks.grow(b, b.num_tokens)
    assert b.block_table[2] not in a.block_table  # its own third block: shared blocks are never written
    blocks.release(a)
    assert [blocks.refs[x] for x in prefix] == [1, 1] and blocks.num_free == 16 - 3  # b's three blocks held


def test_a_wholly_cached_prompt_still_computes_its_last_block():
    blocks = BlockManager(16, P, prefix_caching=True)
    a = computed(blocks, seq(list(range(8))))
    again = seq(list(range(8)))
    assert blocks.cached_prefix(again) == a.block_table[:1]  # its last token's block is computed again
    longer = seq(list(range(9)))
    assert blocks.cached_prefix(longer) == a.block_table[:2]


def test_freed_blocks_stay_findable_until_evicted_least_recently_freed_first():
    blocks = BlockManager(6, P, prefix_caching=True)
    old = computed(blocks, seq([1] * 4 + [2] * 4 + [3]))  # 3 blocks
    new = computed(blocks, seq([7] * 4 + [8] * 4 + [9]))  # 3 blocks: the pool is full
    blocks.release(old)
    blocks.release(new)
    assert blocks.num_free == 6
    assert len(blocks.cached_prefix(seq([1] * 4 + [2] * 4 + [3]))) == 2  # still there, though free
    taker = seq([5] * 9)
    assert blocks.can_hold(taker, 9)
    blocks.grow(taker, 9)  # three fresh blocks: the oldest freed go first, `old`'s (its last block first)
    assert blocks.cached_prefix(seq([1] * 4 + [2] * 4 + [3])) == []
    assert len(blocks.cached_prefix(seq([7] * 4 + [8] * 4 + [9]))) == 2


def test_taking_a_free_cached_block_counts_against_the_free_ones():
    blocks = BlockManager(3, P, prefix_caching=True)
    a = computed(blocks, seq([1] * 4 + [2] * 4 + [3]))
    blocks.release(a)
    b = seq([1] * 4 + [2] * 4 + [4] * 4 + [5])  # takes 2 free cached blocks, needs 2 more: 4 > 3
    prefix = blocks.cached_prefix(b)
    assert len(prefix) == 2 and not blocks.can_hold(b, b.num_tokens, prefix)
    assert blocks.can_hold(b, 9, prefix)  # 2 taken + 1 fresh


def test_a_token_mismatch_under_an_equal_hash_is_no_hit(monkeypatch):
    blocks = BlockManager(8, P, prefix_caching=True)
    a = computed(blocks, seq(list(range(9))))
    blocks.block_tokens[a.block_table[0]] = (9, 9, 9, 9)  # as if another prefix had hashed alike
    assert blocks.cached_prefix(seq(list(range(9)))) == []


def test_without_caching_or_with_prompt_logprobs_nothing_is_shared():
    plain = BlockManager(8, P)
    computed(plain, seq(list(range(9))))
    assert plain.cached_prefix(seq(list(range(9)))) == [] and not plain.cached
    cached = BlockManager(8, P, prefix_caching=True)
    computed(cached, seq(list(range(9))))
    assert cached.cached_prefix(seq(list(range(9)), prompt_logprobs=1)) == []  # its prompt is computed to score it


def test_the_engine_reports_its_hit_rate_and_aborts_release_only_their_references(device):
    with LLM("tiny-llama", num_blocks=32, block_size=P, device=device) as llm:
        engine = llm.llm_engine
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        first = llm.generate([list(range(1, 10))], greedy)[0].outputs[0].token_ids
        assert engine.stats.prefix_cache_hits == 0 and engine.stats.prefix_cache_queries == 9
        engine.add_request("sharer", list(range(1, 10)) + [20], greedy)
        engine.add_request("other", list(range(1, 10)), greedy)
        engine.step()
        shared = engine.requests["sharer"][0].block_table[:2]
        assert engine.requests["other"][0].block_table[:2] == shared
        assert engine.stats.prefix_cache_hits == 16 and engine.stats.prefix_cache_hit_rate == 16 / 28
        engine.abort_request("sharer")
        assert [engine.blocks.refs[b] for b in shared] == [1, 1]  # "other" still reads them
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
        assert finished[0].outputs[0].token_ids == first
    with pytest.raises(ValueError, match="the contiguous backend does not support prefix caching"):
        LLM("tiny-llama", attention="contiguous", enable_prefix_caching=True, device=device)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_behind_a_sliding_window_go_back_to_the_pool(prefix_caching):
    """W = 6, P = 4: after n computed tokens the next query (at n) sees n - 5 .. n, so the blocks ending before
    n - 5 are free again, their entries 0; releasing frees the rest once each; cached ones stay findable."""
    blocks = BlockManager(8, P, prefix_caching=prefix_caching, window=6)
    s = seq(list(range(9)))
    blocks.grow(s, 9)
    held = list(s.block_table)
    s.num_computed_tokens = 9  # the next query at 9 sees 4 .. 9: block 0 (0 .. 3) is behind
    blocks.commit(s)
    assert s.block_table == [0, *held[1:]] and s.num_dropped_blocks == 1 and blocks.refs[held[0]] == 0
    assert blocks.num_free == 8 - 2
    for n in range(10, 14):  # decodes: n - 5 reaches 8 at n = 13, leaving block 1 (4 .. 7) behind
        s.token_ids.append(n)
        blocks.grow(s, n + 1)
        s.num_computed_tokens = n
        blocks.commit(s)
    assert s.num_dropped_blocks == 2 and s.block_table[:2] == [0, 0] and blocks.num_free == 8 - 2
    if prefix_caching:  # the blocks left behind are registered first: another prompt still finds them
        assert blocks.cached_prefix(seq(list(range(9)))) == held[:2]
    chain = held + s.block_table[len(held) :]
    blocks.release(s)
    assert blocks.num_free == 8 and not any(blocks.refs)
    if prefix_caching:  # the chain's head is evicted last, its next block before it, and so on
        assert list(blocks.free)[-len(chain) :] == chain[::-1]


def test_a_windowed_model_holds_only_its_window_and_serves_hfs_tokens():
    """tiny-mistral (W = 16) in blocks of 4 through a prompt and generation of 80 tokens: once past the window a
    request holds at most the window's blocks and the one being filled, and its tokens are HF's."""
    from weft.inference.config import EngineConfig
    from weft.inference.engine import LLMEngine
    from weft.models.loader import reference_model, resolve_model

    hf = reference_model(resolve_model("tiny-mistral"), torch.float32, torch.device("cpu"))
    prompt = list(range(3, 43))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                       eos_token_id=None)[0, len(prompt):].tolist()
    engine = LLMEngine(EngineConfig(hf, device="cpu", block_size=4, num_blocks=32, max_num_batched_tokens=8))
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    most, out = 0, None
    while engine.has_unfinished_requests():
        for seq in engine.requests.get("r", []):
            most = max(most, len(seq.block_table) - seq.num_dropped_blocks)
        for o in engine.step():
            out = o
    assert out.outputs[0].token_ids == want
    assert most <= 16 // 4 + 3  # the window's blocks, the chunk of 8 being filled, and the block ahead of it
    assert engine.blocks.num_free == 32


def test_with_roles_a_prompt_never_takes_blocks_of_generated_tokens():
    """Deterministic mode computes prompt and generated tokens in kernels of their own
    (AttentionBackend.attends_by_role): a block's hash holds how many of its tokens were generated, so a prompt that
    repeats another request's prompt and output takes only the blocks of its prompt; the request itself, preempted,
    takes its own again."""
    for roles, hits in [(False, 2), (True, 1)]:
        blocks = BlockManager(16, P, prefix_caching=True, roles=roles)
        a = seq(list(range(6)))  # its prompt: block 0 whole, block 1 half
        a.token_ids += [6, 7, 8]  # and three generated tokens: block 1 is half generated
        table = computed(blocks, a).block_table
        repeat = seq(list(range(9)))  # all nine as a prompt
        assert blocks.cached_prefix(repeat) == table[:hits]
        blocks.release(a)
        a.num_computed_tokens = 0  # preempted: its recompute takes both blocks
        assert blocks.cached_prefix(a) == table[:2]

"""The runner's per-step metadata: what the attention backends are told about a step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from weft.attention.paged import PagedBackend
from weft.attention.triton import TritonBackend
from weft.config import ModelConfig
from weft.inference.cuda_graphs import DecodeGraphs
from weft.inference.outputs import RequestMetrics
from weft.inference.params import SamplingParams
from weft.inference.runner import ModelRunner
from weft.inference.scheduler import ScheduledBatch
from weft.inference.sequence import Sequence
from weft.utils import cdiv

pytestmark = pytest.mark.correctness
P = 4
CFG = ModelConfig(
    arch="llama", V=32, E=64, L=1, H_q=2, H_kv=1, D=32, intermediate=32, rms_eps=1e-6, rope_theta=1e4,
    max_model_len=64, tie_word_embeddings=False,
)


def sequence(seq_id: int, num_tokens: int, num_computed: int) -> Sequence:
    seq = Sequence(seq_id, list(range(num_tokens)), num_tokens, SamplingParams(), num_tokens + 8, RequestMetrics(0.0))
    seq.num_computed_tokens = num_computed
    seq.block_table = list(range(10 * seq_id, 10 * seq_id + cdiv(num_tokens, P)))
    return seq


@pytest.mark.parametrize(
    ("new_tokens", "num_decodes"),
    [([1, 1, 1], 3), ([5, 3], 0), ([1, 1, 6, 1], 2), ([7, 1, 1], 0)],
    ids=["decode", "prefill", "mixed", "prefill-first"],
)
def test_num_decodes_counts_the_leading_one_token_requests(new_tokens, num_decodes):
    attn = PagedBackend(CFG, 64, P, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model=None, attn=attn, device=torch.device("cpu"))
    batch = ScheduledBatch()
    for i, T in enumerate(new_tokens):
        batch.add(sequence(i, 9, 9 - T), T)
    meta = runner.prepare(batch).tensors.meta
    assert meta.num_decodes == num_decodes
    assert meta.is_decode == (num_decodes == len(new_tokens))
    assert meta.query_start_loc.diff().tolist() == new_tokens


def test_each_new_token_gets_its_slot_position_and_row():
    """Chunks that start and end mid-block, a decode, a request with more blocks than the others: every
    new token's cache slot is its block's id x P + its offset, the tables are padded to the widest, and
    every tensor starts 16-byte aligned."""
    attn = PagedBackend(CFG, 64, P, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model=None, attn=attn, device=torch.device("cpu"))
    batch = ScheduledBatch()
    spans = [(9, 8), (6, 3), (13, 0)]  # (tokens known, tokens computed before this step)
    for i, (n, computed) in enumerate(spans):
        batch.add(sequence(i, n, computed), n - computed)
    x = runner.prepare(batch).tensors
    want_slots, want_pos, want_ids = [], [], []
    for i, (n, computed) in enumerate(spans):
        want_pos += range(computed, n)
        want_ids += range(computed, n)  # sequence() makes token p the id p
        want_slots += [(10 * i + p // P) * P + p % P for p in range(computed, n)]
    assert x.meta.slot_mapping.tolist() == want_slots and x.meta.slot_mapping.dtype == torch.int64
    assert x.positions.tolist() == want_pos and x.input_ids.tolist() == want_ids
    assert x.meta.context_lens.tolist() == [9, 6, 13] and x.meta.context_lens.dtype == torch.int32
    assert x.meta.block_tables.tolist() == [[0, 1, 2, 0], [10, 11, 0, 0], [20, 21, 22, 23]]
    assert x.logit_rows.tolist() == [0, 3, 16]  # each request's last new token
    # 17 new tokens: odd parts of the one transfer are padded, so each tensor starts as Triton expects
    assert all(t.data_ptr() % 16 == 0 for t in (x.input_ids, x.positions, x.meta.slot_mapping, x.logit_rows))


def test_decodes_sharing_their_first_blocks_reach_the_backend_as_groups():
    """The runner asks the backend for its decodes' groups and sends them with the step: a group per run of decodes
    whose tables begin alike, each decode's shared tokens beside it (0 outside the groups), checked by the backend."""
    cfg = ModelConfig(arch="llama", V=32, E=64, L=1, H_q=2, H_kv=1, D=32, intermediate=32, rms_eps=1e-6,
                      rope_theta=1e4, max_model_len=1024, tie_word_embeddings=False)
    attn = TritonBackend(cfg, 256, 16, torch.float32, torch.device("cpu"))
    attn.check_steps = True
    runner = ModelRunner(model=None, attn=attn, device=torch.device("cpu"))
    prompt = list(range(100, 110))  # the first 10 blocks of 16 tokens, shared by siblings
    batch = ScheduledBatch()
    for i, (context, blocks) in enumerate([(150, prompt), (300, prompt + [1, 2, 3, 4, 5, 6, 7, 8, 9]),
                                           (165, prompt + [10]), (70, [20, 21, 22, 23, 24]), (40, [30, 31, 32])]):
        seq = Sequence(i, list(range(context)), 20, SamplingParams(), 400, RequestMetrics(0.0))
        seq.num_computed_tokens, seq.block_table = context - (1 if i < 4 else 30), blocks
        batch.add(seq, 1 if i < 4 else 30)
    meta = runner.prepare(batch).tensors.meta
    attn.check(meta)
    assert meta.decode_groups.tolist() == [[0, 3, 128]] and meta.shared_lens.tolist() == [128, 128, 128, 0, 0]
    alone = ScheduledBatch()
    alone.add(batch.seqs[3], 1)
    assert runner.prepare(alone).tensors.meta.decode_groups is None


def test_a_batch_invariant_triton_step_tells_each_requests_prompt_tokens():
    """Where the backend attends by role (deterministic mode), each request's new tokens that are prompt tokens are
    sent with the step: a whole prompt, a chunk that ends in the prompt, a chunk past it (a preempted request's
    recompute), a decode; a step of one-token prompts alone is no decode step for the decode graphs."""
    attn = TritonBackend(CFG, 64, P, torch.float32, torch.device("cpu"))
    attn.check_steps = True
    runner = ModelRunner(model=None, attn=attn, device=torch.device("cpu"))
    assert not PagedBackend(CFG, 64, P, torch.float32, torch.device("cpu")).attends_by_role
    attn.batch_invariant = True
    batch = ScheduledBatch()
    for i, (n, prompt, computed) in enumerate([(9, 9, 8), (9, 4, 8), (12, 12, 0), (12, 10, 4), (13, 5, 0)]):
        seq = sequence(i, n, computed)
        seq.num_prompt_tokens = prompt
        batch.add(seq, n - computed)
    meta = runner.prepare(batch).tensors.meta
    attn.check(meta)
    assert meta.prompt_tokens.tolist() == [1, 0, 12, 6, 5] and meta.num_prompt_tokens == 24
    cached = ScheduledBatch()  # a prompt whose tokens but the last the prefix cache held, beside a decode
    cached.add(batch.seqs[0], 1)
    cached.add(batch.seqs[1], 1)
    meta = runner.prepare(cached).tensors.meta
    assert meta.is_decode and meta.prompt_tokens.tolist() == [1, 0] and meta.num_prompt_tokens == 1
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # its captures need a GPU; `serves` reads only their sizes
    graphs.sizes = [1, 2, 4]
    assert not graphs.serves(meta)
    meta.prompt_tokens[0], meta.num_prompt_tokens = 0, 0
    assert graphs.serves(meta)
    meta.prompt_tokens[1] = 2  # more prompt tokens than new ones
    with pytest.raises(ValueError, match="prompt_tokens"):
        attn.check(meta)
    with pytest.raises(ValueError, match="prompt_tokens"):  # prompt tokens counted, but not told whose
        attn.check(replace(meta, prompt_tokens=None, num_prompt_tokens=1))

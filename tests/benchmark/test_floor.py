"""The memory-traffic floor counts what the engine reads: the weights once a step over as many steps as the
longest output has tokens (an untied input embedding only by its rows), and every context's K/V once a step."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from weft.benchmark import workloads
from weft.benchmark.floor import floor_s, traffic_bytes, weight_bytes
from weft.inference.config import EngineConfig
from weft.inference.engine import LLMEngine
from weft.inference.params import SamplingParams


def test_the_traffic_is_the_weights_per_step_and_the_contexts_the_engine_reads():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128,
    )).eval()  # fmt: skip
    w = workloads.uniform(4, (3, 20), (1, 9), vocab_size=256, seed=2, name="tiny")
    engine = LLMEngine(EngineConfig(model=hf, attention="paged", dtype="float32", device="cpu", max_model_len=64))
    steps, contexts = 0, 0
    forward = engine.runner.forward

    def counted(x):  # every request is admitted in the first step, so they run side by side to the end
        nonlocal steps, contexts
        steps, contexts = steps + 1, contexts + int(x.meta.context_lens.sum())
        return forward(x)

    engine.runner.forward = counted
    for i, r in enumerate(w.requests):
        engine.add_request(str(i), list(r.prompt_token_ids), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # the input embedding is not tied to the output layer here: a pass reads only its tokens' rows of it
    weights = sum(p.numel() * p.element_size() for name, p in hf.named_parameters() if "embed_tokens" not in name)
    kv_per_token = 2 * 3 * 2 * 16 * 4  # K and V, L layers, H_kv heads of D = 64 / 4, float32
    assert steps == max(r.max_tokens for r in w.requests) > min(r.max_tokens for r in w.requests)
    assert traffic_bytes(w, hf) == steps * weights + contexts * kv_per_token


def test_a_tied_embedding_is_read_whole_as_the_output_layer():
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=1000, max_position_embeddings=64)
    tied, untied = (LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=t)) for t in (True, False))
    embedding = 1000 * 32 * 4
    assert weight_bytes(tied) == sum(p.numel() * 4 for p in tied.parameters())  # the one matrix, read whole
    assert weight_bytes(untied) == sum(p.numel() * 4 for p in untied.parameters()) - embedding
    assert weight_bytes(tied) == weight_bytes(untied)  # either way, one output layer's worth


def test_no_floor_off_cuda():
    assert floor_s(10**9, torch.device("cpu")) is None


def test_a_mixture_of_experts_reads_the_experts_its_tokens_touch():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=100,
                            num_experts=8, num_experts_per_tok=2, tie_word_embeddings=True)
    model = Qwen3MoeForCausalLM(config)
    expert = 3 * 16 * 32 * 4  # one expert's gate, up and down, float32
    every = weight_bytes(model)
    assert weight_bytes(model, 1) == every - 2 * (8 - 2) * expert  # each layer reads its 2 experts of 8
    assert weight_bytes(model, 4) == every - round(2 * 8 * expert * 0.75**4)
    assert weight_bytes(model, 1) < weight_bytes(model, 4) < weight_bytes(model, 256) <= every

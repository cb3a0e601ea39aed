"""ModelConfig: the few numbers weft needs from a HuggingFace config, in the seed's symbols."""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> the transformers class weft reimplements
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
}  # fmt: skip


def check_architecture(model_type: str | None) -> None:
    """A ValueError naming the architectures weft serves, for a `model_type` not among them."""
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: weft supports {', '.join(SUPPORTED_ARCHITECTURES.values())}"
        )


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE frequency scaling (rope_type "llama3"): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched `factor` times, shorter than
    original_max_position_embeddings / high_freq_factor kept, and those between blended linearly in
    original_max_position_embeddings / wavelength."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoEConfig:
    """Qwen3-MoE's sparse MLP: a router picks each token's top_k of num_experts experts (SwiGLUs of
    intermediate columns), whose outputs it sums weighted by their router probabilities (renormalised over the
    top_k when norm_topk_prob)."""

    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the layers that have it


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # key of SUPPORTED_ARCHITECTURES
    V: int  # vocabulary size
    E: int  # hidden size
    L: int  # layers
    H_q: int  # query heads
    H_kv: int  # key-value heads
    D: int  # head dimension
    intermediate: int  # MLP hidden size
    rms_eps: float
    rope_theta: float
    max_model_len: int  # longest sequence the positions cover
    tie_word_embeddings: bool
    qkv_bias: bool = False  # biases on q, k and v (Qwen2's; Llama's attention_bias)
    o_bias: bool = False  # a bias on the attention's output projection (Llama's attention_bias)
    mlp_bias: bool = False
    rope_scaling: Llama3Rope | None = None
    sliding_window: int | None = None  # keys a query sees at most, itself included (None: all of them)
    window_layers: tuple[int, ...] = ()  # the layers that attend within it (Mistral's: all; Qwen2's: some)
    moe: MoEConfig | None = None  # the mixture of experts some layers have in place of the MLP

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Reads a transformers Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE config; any other is a ValueError naming
        the ones weft serves."""
        arch = hf_config.model_type
        check_architecture(arch)
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: weft supports 'default' and 'llama3'")
        scaling = None
        if rope_type == "llama3":
            scaling = Llama3Rope(float(rope["factor"]), float(rope["low_freq_factor"]),
                                 float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        H_q = hf_config.num_attention_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        window, window_layers = _sliding_window(hf_config)
        return cls(
            arch=arch,
            V=hf_config.vocab_size,
            E=hf_config.hidden_size,
            L=hf_config.num_hidden_layers,
            H_q=H_q,
            H_kv=hf_config.num_key_value_heads,
            D=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // H_q,
            intermediate=hf_config.intermediate_size,
            rms_eps=hf_config.rms_norm_eps,
            rope_theta=float(theta),
            max_model_len=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(hf_config.tie_word_embeddings),
            qkv_bias=attention_bias or arch == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=window,
            window_layers=window_layers,
            moe=_moe(hf_config),
        )


def _moe(hf_config) -> MoEConfig | None:
    """Qwen3-MoE's experts: in every decoder_sparse_step-th layer not in mlp_only_layers, as HF places them."""
    if hf_config.model_type != "qwen3_moe" or not hf_config.num_experts:
        return None
    if hf_config.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} for the experts: weft's are SwiGLUs")
    skip, step = set(hf_config.mlp_only_layers), hf_config.decoder_sparse_step
    layers = tuple(i for i in range(hf_config.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
    return MoEConfig(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                     bool(hf_config.norm_topk_prob), layers)


def _sliding_window(hf_config) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers that attend within it: Mistral's sliding_window in every layer, Qwen2's in the
    layers its layer_types make sliding (where use_sliding_window); (None, ()) for none."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None, ()
    if hf_config.model_type == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        return None, ()
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return (int(window), layers) if layers else (None, ())

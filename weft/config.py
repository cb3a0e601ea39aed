"""ModelConfig: the few numbers weft needs from a HuggingFace config, in the seed's symbols."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


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
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Reads a transformers `LlamaConfig` / `Qwen3Config`; anything else is a ValueError."""
        arch = hf_config.model_type
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: weft supports {', '.join(SUPPORTED_ARCHITECTURES.values())}"
            )
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}: weft supports 'default'")
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        H_q = hf_config.num_attention_heads
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
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )

"""Models reimplemented on weft's layers, by HF `model_type`."""

from __future__ import annotations

from weft.config import ModelConfig
from weft.models.llama import LlamaForCausalLM
from weft.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}


def build_model(cfg: ModelConfig) -> LlamaForCausalLM:
    return MODELS[cfg.arch](cfg)

"""Models reimplemented on weft's layers, by HF `model_type`."""

from __future__ import annotations

import torch

from weft.config import ModelConfig
from weft.distributed import SINGLE, TensorParallel
from weft.models.llama import LlamaForCausalLM
from weft.models.qwen3 import Qwen3ForCausalLM

# Mistral and Qwen2 are Llama's decoder as their ModelConfig sets it up (biases, window), Qwen3-MoE Qwen3's with
# experts (ModelConfig.moe): no class of their own
MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,  # its experts are in the layers its MoEConfig names
}  # fmt: skip


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
) -> LlamaForCausalLM:
    """`cfg`'s model (`tp`'s slice of it) in `dtype` on `device`, in eval mode, its weights placeholders to
    load into.

    Parameters are created where and as they will live (device and dtype): a large model built in
    float32 on the host and then moved costs tens of seconds. Not thread-safe: the default dtype is
    the process's while the model is built.
    """
    model_cls = MODELS[cfg.arch]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg, tp)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype).eval()  # buffers built in float32 on purpose (rotary tables) follow too

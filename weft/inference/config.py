"""EngineConfig: every engine option in one frozen dataclass, checked in one place.

`LLM(**options)`, the benchmarks, `weft check` and the server all build this object. Its own
checks (`__post_init__`) need no model; `for_model` then fills in and checks what depends on
the model's shape (the context length, what a backend can run), before any weight is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from weft.attention import available_backends, get_backend
from weft.config import ModelConfig
from weft.distributed import check_tensor_parallel
from weft.inference.scheduler import SCHEDULERS
from weft.utils import as_int, as_real

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CPU_KV_CACHE_BYTES = 4 << 30  # the CPU pool's default budget (kv_cache_memory_bytes); pages are taken as used
# vLLM's names: decode steps from whole-forward graphs and other steps piecewise (and, where the backend counts its
# steps on the device, steps of decodes and a few prompts whole too), or only one of the two
CUDAGRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")
GENERATION_CONFIGS = ("auto", "vllm")
CHUNKED_BUDGET = 8192  # max_num_batched_tokens' default with chunked prefill (vLLM's for its server)


@dataclass(frozen=True)
class EngineConfig:
    model: str | os.PathLike | Any = "smollm2-135m-instruct"  # see weft.models.loader.resolve_model
    tokenizer: str | os.PathLike | None = None  # the model's own; else the default model's name or a directory
    attention: str = "paged"
    scheduler: str = "continuous"
    block_size: int = 16  # P (the contiguous backend's rows hold max_model_len tokens instead)
    num_blocks: int | None = None  # N; None: from kv_cache_memory_bytes, or a share of free GPU memory
    max_num_seqs: int = 256  # requests one step may hold
    max_num_batched_tokens: int | None = None  # new tokens one step may hold; None: see for_model
    enable_chunked_prefill: bool = True  # prefill long prompts in chunks, in steps shared with decodes
    enable_prefix_caching: bool | None = None  # share prompts' common prefixes; None: where the backend can
    max_model_len: int | None = None  # longest prompt + completion; None: the model's context
    dtype: str | torch.dtype = "float32"
    device: str | torch.device | None = None  # None: "cuda" when there is one, else "cpu"
    gpu_memory_utilization: float = 0.9  # CUDA, num_blocks and kv_cache_memory_bytes None: this share of the card
    kv_cache_memory_bytes: int | None = None  # the pool's bytes; None: CUDA as above, CPU CPU_KV_CACHE_BYTES
    enforce_eager: bool = False  # no CUDA graphs (cudagraph_mode "NONE", as in vLLM)
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # CUDA: which steps replay graphs (CUDAGRAPH_MODES, cuda_graphs.py)
    enable_overlap: bool | None = None  # plan and queue step k+1 while step k runs, then land k; None: on CUDA
    enable_fused_layers: bool = True  # CUDA: norms, RoPE (+ K/V store), SiLU x up as Triton kernels; else PyTorch's
    # CUDA, with the fused layers: a decode's linear layers by the launches tuned for this GPU where they beat cuBLAS
    enable_tuned_gemms: bool = True
    tensor_parallel_size: int = 1  # ranks that each hold a slice of the model (processes; GPUs on CUDA)
    max_logprobs: int = 20  # the most alternatives a request's logprobs or prompt_logprobs may ask for (vLLM's)
    # batch-invariant kernels: a request's tokens and logprobs the same bits whatever runs beside it (DETERMINISM)
    deterministic: bool = False
    # vLLM's: "auto", a checkpoint's generation_config.json sampling fields are the defaults of a request that does
    # not set them (LLM.generate without SamplingParams, the server); "vllm", SamplingParams' own
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        check_names(self.attention, self.scheduler, self.cudagraph_mode)
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "kv_cache_memory_bytes", "tensor_parallel_size", "max_logprobs"):
            value = getattr(self, name)
            if value is None and name not in ("block_size", "max_num_seqs", "tensor_parallel_size", "max_logprobs"):
                continue
            value = as_int(name, value)
            least = 0 if name == "max_logprobs" else 1
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
            set_(self, name, value)
        if self.tokenizer is not None and not isinstance(self.tokenizer, str | os.PathLike):
            raise TypeError(f"tokenizer must be a name or a directory, got {type(self.tokenizer).__name__}")
        set_(self, "dtype", _dtype_name(self.dtype))
        set_(self, "device", _device(self.device))
        fraction = as_real("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        set_(self, "gpu_memory_utilization", fraction)
        for name in ("enforce_eager", "enable_chunked_prefill", "enable_prefix_caching", "enable_overlap",
                     "enable_fused_layers", "enable_tuned_gemms", "deterministic"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in ("enable_prefix_caching",
                                                                                "enable_overlap")):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, got "
                             f"{self.generation_config!r}")
        if self.enforce_eager:
            set_(self, "cudagraph_mode", "NONE")
        if self.enable_overlap is None:  # on the CPU a step runs as it is queued: nothing to overlap it with
            set_(self, "enable_overlap", self.device.type == "cuda")
        if self.attention not in available_backends(self.device):
            raise ValueError(
                f"the {self.attention} backend cannot run on {self.device.type}: there choose from "
                f"{', '.join(available_backends(self.device))}"
            )
        shares = not self.backend.row_per_request  # a request's row of the contiguous slab is its own
        if self.enable_prefix_caching and not shares:
            raise ValueError(f"the {self.attention} backend does not support prefix caching (each request owns a "
                             "row of the slab): use paged or triton, or enable_prefix_caching=False")
        if self.enable_prefix_caching is None:
            set_(self, "enable_prefix_caching", shares)
        tp = self.tensor_parallel_size
        if tp > 1 and self.device.type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp}, but this machine has {torch.cuda.device_count()} CUDA "
                             "device(s)")
        if tp > 1 and not isinstance(self.model, str | os.PathLike):
            raise ValueError(f"tensor_parallel_size={tp} needs a model by name or directory, which every rank loads "
                             "its slice of; an in-memory model stays in this process")
        if self.deterministic:
            check_deterministic(self)
        most = self.backend.max_decodes
        if most is not None and self.max_num_seqs > most:
            raise ValueError(
                f"max_num_seqs is {self.max_num_seqs}; the {self.attention} backend decodes at most {most} per step"
            )

    @property
    def backend(self) -> type:
        """The attention backend's class."""
        return get_backend(self.attention)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def for_model(self, model: ModelConfig) -> EngineConfig:
        """This config with the model's limits filled in: max_model_len (refused above the model's context, as
        vLLM does) and
        max_num_batched_tokens (CHUNKED_BUDGET with chunked prefill, else max_model_len: a whole prompt in one
        step); and the backend's checks of the shape."""
        context = model.max_model_len
        if self.max_model_len is not None and self.max_model_len > context:
            raise ValueError(f"max_model_len={self.max_model_len} is above the model's context of {context} tokens")
        self.backend.check_model(model)
        if self.deterministic and model.moe is not None:
            raise ValueError("deterministic=True: the mixture-of-experts kernel groups a step's tokens by expert, so a "
                             "token's sums follow its batch; no batch-invariant MoE kernel yet")
        check_tensor_parallel(self.tensor_parallel_size, model)
        max_model_len = self.max_model_len or context
        budget = self.max_num_batched_tokens or (CHUNKED_BUDGET if self.enable_chunked_prefill else max_model_len)
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget)


# What deterministic=True promises, and where it holds.
DETERMINISM = (
    "for one model, dtype, engine configuration and seed, a request's tokens and logprobs are the same bits "
    "whether it runs alone or beside others, its prompt computed whole, in chunks or read from the prefix cache, "
    "before or after a preemption, with the overlap on or off"
)


def check_deterministic(config: EngineConfig) -> None:
    """ValueError for a deterministic config whose kernels could not keep its promise (DETERMINISM)."""
    if config.tensor_parallel_size > 1:
        raise ValueError("deterministic=True needs tensor_parallel_size=1: the ranks' all-reduce sums in an order of "
                         "its own")
    if config.device.type == "cuda":
        if config.attention != "triton":
            raise ValueError(f"deterministic=True on CUDA needs attention='triton', whose kernels fold every query's "
                             f"keys in one fixed order; {config.attention!r} runs PyTorch's SDPA")
        if not config.enable_fused_layers:
            raise ValueError("deterministic=True on CUDA needs enable_fused_layers=True: the fused norms reduce each "
                             "row in one program, PyTorch's reductions split rows as the batch allows")


def check_names(attention: object, scheduler: object, cudagraph_mode: object) -> None:
    """ValueError for an attention backend, scheduler or CUDA-graph mode weft does not have (TypeError for a
    non-str)."""
    for name, value in (("attention", attention), ("scheduler", scheduler), ("cudagraph_mode", cudagraph_mode)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {value!r}")
    get_backend(attention)  # names the backends there are
    for name, value, known in (("scheduler", scheduler, SCHEDULERS), ("cudagraph_mode", cudagraph_mode,
                                                                        CUDAGRAPH_MODES)):
        if value not in known:
            raise ValueError(f"unknown {name} {value!r}: choose from {', '.join(known)}")


def _dtype_name(dtype: object) -> str:
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"unsupported dtype {dtype}: choose from {', '.join(DTYPES)}")
        return names[dtype]
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or a torch.dtype, got {dtype!r}")
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    return name


def _device(device: object) -> torch.device:
    """The device to serve on; ValueError for one torch does not know, or weft cannot use here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be a str or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}, but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"weft serves on 'cpu' or 'cuda', not {device.type!r}")
    return device

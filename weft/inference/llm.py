"""LLM: the public entry point, with vLLM's names (`LLM`, `SamplingParams`, `generate`)."""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq

import torch
from transformers import PreTrainedModel

from weft.attention import AttentionBackend, get_backend
from weft.attention.contiguous import ContiguousBackend
from weft.inference.block_manager import BlockManager
from weft.inference.cuda_graphs import DecodeGraphs
from weft.inference.engine import LLMEngine
from weft.inference.outputs import EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import SamplingParams
from weft.inference.runner import ModelRunner
from weft.inference.scheduler import get_scheduler
from weft.inference.sequence import Sequence
from weft.models import build_model
from weft.models.loader import DEFAULT_MODEL, load_model
from weft.models.weights import load_hf_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLM:
    """Loads a model and serves `generate` calls with the chosen attention backend and scheduler.

    Pool: `num_blocks` blocks of `block_size` tokens (paged, triton) or `num_blocks` rows of
    `max_model_len` tokens (contiguous). `num_blocks=None` sizes it from free GPU memory
    (`gpu_memory_utilization` of the card) on CUDA, and to fit each `generate` call's
    requests on the CPU. On CUDA, decode steps of a backend that allows it (triton) replay
    CUDA graphs captured here, unless `enforce_eager`.
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel = DEFAULT_MODEL,
        attention: str = "paged",
        scheduler: str = "continuous",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
    ) -> None:
        self.backend_cls = get_backend(attention)
        self.scheduler_cls = get_scheduler(scheduler)
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")
        for name, value in (
            ("num_blocks", num_blocks),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_num_seqs = max_num_seqs or 256
        most = self.backend_cls.max_decodes
        if most is not None and self.max_num_seqs > most:
            raise ValueError(
                f"max_num_seqs is {self.max_num_seqs}; the {attention} backend decodes at most {most} per step"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available here")
        self.dtype = DTYPES[dtype]

        loaded = load_model(model, self.dtype, self.device)
        self.model_name = loaded.name
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self._hf_model = loaded.hf_model
        self.model = build_model(cfg, self.dtype, self.device)
        load_hf_weights(self.model, loaded.hf_model.state_dict())
        eos = loaded.hf_model.generation_config.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)

        self.max_model_len = min(max_model_len or cfg.max_model_len, cfg.max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens or self.max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.requested_blocks = num_blocks
        self.requested_block_size = block_size
        self.fit_pool_per_call = num_blocks is None and self.device.type != "cuda"
        self.attn: AttentionBackend | None = None if self.fit_pool_per_call else self._make_pool(num_blocks)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.backend_cls.cuda_graphs and not enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.attn, self.max_num_seqs, self.max_model_len)
        self.stats = EngineStats()

    @property
    def num_blocks(self) -> int | None:
        """N of the pool in use (fitted per call: the last call's; None before the first)."""
        return self.attn.num_blocks if self.attn else None

    @property
    def block_size(self) -> int:
        """P of the pool in use (S_max for contiguous)."""
        return self.attn.block_size if self.attn else self._pool_block_size()

    def hf_model(self) -> PreTrainedModel:
        """The transformers model holding the very weights weft serves (the reference)."""
        return self._hf_model

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        arrivals: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Serve all prompts to completion; outputs come back in prompt order.

        `arrivals[i]` is the engine tick at which request i joins the queue (default 0).
        Every check runs before any work: a bad request raises ValueError and nothing runs.
        """
        seqs = self._make_sequences(prompts, sampling_params, arrivals)
        if not seqs:
            return []
        attn = self._pool_for(seqs)
        scheduler = self.scheduler_cls(
            BlockManager(attn.num_blocks, attn.block_size), self.max_num_seqs, self.max_num_batched_tokens
        )
        runner = ModelRunner(self.model, attn, self.device, self.graphs)
        engine = LLMEngine(runner, scheduler, self.eos_ids, self.max_model_len)
        for seq in seqs:
            engine.add_request(seq)
        while engine.has_unfinished():
            engine.step()
        self.stats = engine.stats
        return [self._output(seq) for seq in seqs]

    def _make_sequences(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        arrivals: Seq[int] | None,
    ) -> list[Sequence]:
        n = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        arrivals = [0] * n if arrivals is None else list(arrivals)
        if len(arrivals) != n:
            raise ValueError(f"got {len(arrivals)} arrivals for {n} prompts")
        seqs = []
        for i, (prompt, p, tick) in enumerate(zip(prompts, params, arrivals, strict=True)):
            if not isinstance(tick, int) or tick < 0:
                raise ValueError(f"arrivals[{i}] must be an integer tick >= 0, got {tick!r}")
            ids = self._token_ids(i, prompt)
            gen = None
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(self.device).manual_seed(p.seed)
            seqs.append(
                Sequence(
                    seq_id=i,
                    token_ids=ids,
                    num_prompt_tokens=len(ids),
                    params=p,
                    max_len=min(len(ids) + p.max_tokens, self.max_model_len),
                    metrics=RequestMetrics(arrival_tick=tick, arrival_time=0.0),
                    generator=gen,
                )
            )
        return seqs

    def _token_ids(self, i: int, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but model {self.model_name!r} has no tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        V = self.model_config.V
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {V}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; the model's context (max_model_len) is {self.max_model_len}, "
                "which must leave room for at least one new token"
            )
        if len(ids) > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, more than max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        return ids

    def _pool_block_size(self, seqs: list[Sequence] | None = None) -> int:
        """P: the block size, or S_max for the contiguous backend (fitted to `seqs` when given)."""
        if self.backend_cls is not ContiguousBackend:
            return self.requested_block_size
        return max(s.max_kv_tokens for s in seqs) if seqs else self.max_model_len

    def _make_pool(self, num_blocks: int | None, seqs: list[Sequence] | None = None) -> AttentionBackend:
        P = self._pool_block_size(seqs)
        if num_blocks is None and seqs is not None:  # CPU: just enough for these requests
            if self.backend_cls is ContiguousBackend:
                num_blocks = min(len(seqs), self.max_num_seqs)
            else:
                num_blocks = sum(-(-s.max_kv_tokens // P) for s in seqs)
        if num_blocks is None:  # CUDA: a share of free memory
            free, total = torch.cuda.mem_get_info(self.device)
            # memory PyTorch has cached but not handed out (an earlier pool, say) is free to us too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget = free - (1 - self.gpu_memory_utilization) * total
            num_blocks = int(budget // self.backend_cls.block_bytes(self.model_config, P, self.dtype))
            if self.backend_cls is ContiguousBackend:
                num_blocks = min(num_blocks, self.max_num_seqs)
            if num_blocks < 1:
                raise ValueError(f"no GPU memory left for a KV pool of {self.backend_cls.name} blocks of {P} tokens")
        return self.backend_cls(self.model_config, num_blocks, P, self.dtype, self.device)

    def _pool_for(self, seqs: list[Sequence]) -> AttentionBackend:
        """The pool this call runs on; every request must fit in it alone, or nothing runs."""
        if self.fit_pool_per_call:
            self.attn = None  # free the last call's pool before making this one
            self.attn = self._make_pool(None, seqs)
            return self.attn
        N, P = self.attn.num_blocks, self.attn.block_size
        for s in seqs:
            need = -(-s.max_kv_tokens // P)
            if need > N:
                raise ValueError(
                    f"request {s.seq_id} needs {s.max_kv_tokens} cache slots ({need} blocks of {P}); "
                    f"the pool has {N} blocks, so it could never run"
                )
        return self.attn

    def _output(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return RequestOutput(
            seq.seq_id, seq.token_ids[: seq.num_prompt_tokens], ids, text, seq.finish_reason, seq.metrics
        )

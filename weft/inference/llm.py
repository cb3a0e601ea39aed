"""LLM: the offline entry point, with vLLM's names; a thin loop over one persistent `LLMEngine`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from weft.inference.chat import chat_prompt, is_conversation
from weft.inference.config import EngineConfig
from weft.inference.engine import LLMEngine
from weft.inference.inputs import prompt_list
from weft.inference.outputs import RequestOutput
from weft.inference.params import RequestOutputKind, SamplingParams, check_sampling_params
from weft.models.loader import DEFAULT_MODEL


class LLM:
    """`LLM(model, **options)`: `options` are EngineConfig's (attention, scheduler, block_size, num_blocks,
    max_num_seqs, max_model_len, dtype, device, ...), checked before anything is loaded. The engine,
    `llm.llm_engine`, is built here and lives as long as the LLM; `close()` (or leaving a `with`
    block, or dropping the last reference) gives its memory back."""

    def __init__(self, model: Any = DEFAULT_MODEL, **options: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **options))
        self._request_ids = itertools.count()  # generate's ids: unique for the engine's lifetime

    def get_tokenizer(self) -> Any | None:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no SamplingParams: the model's generation_config.json sampling
        fields over SamplingParams' own (EngineConfig.generation_config), as in vLLM."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Serve prompts to completion; outputs come back in prompt order.

        `prompts`: one prompt or a list (see weft.inference.inputs); `sampling_params`: one for all,
        or one per prompt (None: get_default_sampling_params()). Every prompt is checked before any is queued: a
        bad one raises and nothing runs.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r:.60}")
        finals = [dataclasses.replace(check_sampling_params(p, f"sampling_params[{i}]"),
                                      output_kind=RequestOutputKind.FINAL_ONLY) for i, p in enumerate(params)]
        engine = self.llm_engine
        ids = [str(next(self._request_ids)) for _ in prompts]
        ours = set(ids)
        engine.add_requests(ids, prompts, finals, labels=[f"prompt {i}" for i in range(len(prompts))])
        done: dict[str | int, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
                while len(done) < len(ids):
                    for out in engine.step():
                        if out.finished and out.request_id in ours:
                            done[out.request_id] = out
                            bar.update()
        finally:  # an exception mid-run leaves none of this call's requests behind in the engine
            engine.abort_request([rid for rid in ids if rid not in done])
        return [done[rid] for rid in ids]

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation ([{"role", "content"}, ...]) or a list of them, through the model's
        chat template (the server's /v1/chat/completions takes the same path), with vLLM's template options
        (weft.inference.chat.chat_prompt)."""
        engine = self.llm_engine
        conversations = [messages] if is_conversation(messages) else messages
        if isinstance(conversations, str) or not isinstance(conversations, Sequence):
            raise TypeError(f"messages must be a conversation or a list of them, got {messages!r:.60}")
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template_kwargs=chat_template_kwargs)
        prompts = [chat_prompt(engine.tokenizer, c, engine.model_name, **options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def close(self) -> None:
        """Free the model, KV pool and CUDA graphs now."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

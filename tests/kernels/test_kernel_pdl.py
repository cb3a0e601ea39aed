"""Programmatic dependent launch (weft.layers.fused.dependent_launch): on where the GPU has it, off elsewhere, and it
changes no bits. On an H200, a decode of Qwen3-0.6B's shape runs its norms, RoPE, split decode attention and tuned
decode GEMMs as dependent launches, in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from weft.inference.llm import LLM
from weft.inference.params import SamplingParams
from weft.layers import fused
from weft.layers.fused import dependent_launch


def test_off_cuda_no_kernel_launches_dependently():
    assert dependent_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.gpu
def test_dependent_launch_changes_no_tokens_or_logprobs(monkeypatch):
    if not dependent_launch(torch.device("cuda"))["PDL"]:
        pytest.skip(f"{torch.cuda.get_device_name()} has no programmatic dependent launch (Hopper and later do)")
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 1000, (n,), generator=g).tolist()} for n in (5, 300, 77)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(fused, "_capability", lambda index: 8)  # as a GPU without it
        assert dependent_launch(torch.device("cuda"))["PDL"] == on
        with LLM("qwen3-0.6b", attention="triton", dtype="bfloat16", device="cuda", max_num_seqs=4,
                 max_model_len=1024, num_blocks=256) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in outs])
    assert runs[0] == runs[1]

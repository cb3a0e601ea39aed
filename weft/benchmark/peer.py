"""HF's own server as e9's peer: `transformers serve` (its continuous batching) on the very weights weft serves.

`transformers serve` takes text prompts only and stops at the model's EOS, so the checkpoint it
loads is a NAMED_CONFIGS model's seeded random weights saved with a word-level tokenizer of
"t<id>" words (the text "t5 t17" is the ids 5, 17 and back; weft.benchmark.serving's `words`
prompt format) and no EOS: every request runs to its max_tokens, as weft's do with ignore_eos.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from weft.models.loader import reference_model, resolve_model

SERVE = "from transformers.cli.transformers import main; main()"  # the `transformers` command, by this Python


def write_checkpoint(model: str, dtype: torch.dtype, path: Path, max_shard_size: str = "5GB") -> Path:
    """`model`'s weights (as weft loads them) with a word-level tokenizer and no EOS, into `path` (in shards of
    at most `max_shard_size`, with their model.safetensors.index.json, where one file would be larger)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    source = resolve_model(model)
    hf_model = reference_model(source, dtype, torch.device("cpu"))
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = None
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(source.config.V)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_model.save_pretrained(path, max_shard_size=max_shard_size)
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(path)
    return path


def start_server(
    checkpoint: Path, port: int, device: str, dtype: str, cb_options: dict | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`transformers serve CHECKPOINT --continuous-batching` on 127.0.0.1:`port` (not yet ready)."""
    args = [sys.executable, "-c", SERVE, "serve", str(checkpoint), "--continuous-batching", "--device", device,
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    for key, value in (cb_options or {}).items():
        args += [f"--cb-{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

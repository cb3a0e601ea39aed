"""weft: a from-scratch LLM serving stack, checked token for token against HuggingFace."""

import logging
import os
from importlib import import_module

# Imported on first use, so that `import weft` and light submodules (weft.remote: a laptop that
# sends the work to Modal) do not pay for torch and transformers.
_EXPORTS = {
    "LLM": "weft.inference.llm",
    "LLMEngine": "weft.inference.engine",
    "EngineConfig": "weft.inference.config",
    "SamplingParams": "weft.inference.params",
    "RequestOutputKind": "weft.inference.params",
    "StructuredOutputsParams": "weft.inference.structured",
    "RequestOutput": "weft.inference.outputs",
    "CompletionOutput": "weft.inference.outputs",
    "RequestMetrics": "weft.inference.outputs",
    "EngineStats": "weft.inference.outputs",
}

__all__ = list(_EXPORTS)

# weft's start-up lines (the KV pool's size, ...) go to stderr at INFO, as vLLM's do;
# WEFT_LOG_LEVEL=WARNING quiets them.
_logger = logging.getLogger("weft")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("weft %(levelname)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(os.environ.get("WEFT_LOG_LEVEL", "INFO").upper())
    _logger.propagate = False


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'weft' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)

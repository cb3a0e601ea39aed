"""weft: a from-scratch LLM serving stack, checked token for token against HuggingFace."""

from importlib import import_module

# Imported on first use, so that importing a light submodule (weft.remote: a laptop that sends
# the work to Modal) does not pay for torch and transformers.
_EXPORTS = {
    "LLM": "weft.inference.llm",
    "EngineStats": "weft.inference.outputs",
    "RequestMetrics": "weft.inference.outputs",
    "RequestOutput": "weft.inference.outputs",
    "SamplingParams": "weft.inference.params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'weft' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)

"""weft: a from-scratch LLM serving stack, checked token for token against HuggingFace."""

from weft.inference.llm import LLM
from weft.inference.outputs import EngineStats, RequestMetrics, RequestOutput
from weft.inference.params import SamplingParams

__all__ = ["LLM", "EngineStats", "RequestMetrics", "RequestOutput", "SamplingParams"]

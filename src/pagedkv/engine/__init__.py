"""A continuous-batching engine that runs transformers causal LMs on pagedkv pages."""

from pagedkv.engine.engine import EngineStats, LLMEngine
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Request", "SamplingParams"]

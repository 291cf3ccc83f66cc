"""A continuous-batching engine that runs transformers causal LMs (and BART-style encoder-decoders) on pagedkv pages."""

from pagedkv.engine.encoder_decoder import EncoderDecoderEngine, EncoderDecoderRequest
from pagedkv.engine.engine import EngineStats, LLMEngine
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import SamplingParams

__all__ = ["EncoderDecoderEngine", "EncoderDecoderRequest", "EngineStats", "LLMEngine", "Request", "SamplingParams"]

"""specserve: LLM inference and serving built around DSpark speculative decoding."""

from specserve.config import EngineConfig, SamplingParams, SpecserveError
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "EngineConfig", "SpecserveError", "RequestOutput", "CompletionOutput"]

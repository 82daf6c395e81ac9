"""specserve: LLM inference and serving built around DSpark speculative decoding.

The public names load on first use: `specserve --help` and the configuration classes need no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.lazy import lazy_exports

_EXPORTS = {
    "LLM": "specserve.llm",
    "SamplingParams": "specserve.config",
    "EngineConfig": "specserve.config",
    "SpecserveError": "specserve.config",
    "RequestOutput": "specserve.engine.outputs",
    "CompletionOutput": "specserve.engine.outputs",
}
__all__ = ["LLM", "SamplingParams", "EngineConfig", "SpecserveError", "RequestOutput", "CompletionOutput"]
__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from specserve.config import EngineConfig, SamplingParams, SpecserveError
    from specserve.engine.outputs import CompletionOutput, RequestOutput
    from specserve.llm import LLM

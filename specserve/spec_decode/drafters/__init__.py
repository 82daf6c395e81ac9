"""Drafters propose tokens for the target to verify; `build_drafter` picks one by the config's method."""

from __future__ import annotations

from collections.abc import Callable

from specserve.config import SpeculativeConfig
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.drafters.base import Drafter
from specserve.spec_decode.drafters.draft_model import DraftModelDrafter
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.spec_decode.drafters.gemma4_assistant import Gemma4AssistantDrafter
from specserve.spec_decode.drafters.mtp import MTPDrafter
from specserve.spec_decode.drafters.ngram import NgramDrafter


def _mtp(config: SpeculativeConfig, target: TargetContext) -> Drafter:
    """The target's own multi-token-prediction layer, or a Gemma 4 assistant checkpoint (`model`)."""
    drafter = Gemma4AssistantDrafter if config.model else MTPDrafter
    return drafter.from_config(config, target)


DRAFTERS: dict[str, Callable[[SpeculativeConfig, TargetContext], Drafter]] = {
    "ngram": NgramDrafter.from_config,
    "draft_model": DraftModelDrafter.from_config,
    "dspark": DSparkDrafter.from_config,
    "dflash": DSparkDrafter.from_config,  # the same backbone without the sequential heads
    "eagle3": Eagle3Drafter.from_config,
    "mtp": _mtp,
}


def build_drafter(config: SpeculativeConfig, target: TargetContext) -> Drafter:
    return DRAFTERS[config.method](config, target)


__all__ = ["DRAFTERS", "Drafter", "build_drafter"]

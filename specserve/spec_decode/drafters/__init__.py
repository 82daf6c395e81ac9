"""Drafters propose tokens for the target to verify; `build_drafter` picks one from the config."""

from __future__ import annotations

from specserve.config import SpeculativeConfig
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.drafters.base import Drafter


def build_drafter(config: SpeculativeConfig, target: TargetContext) -> Drafter:
    if config.method == "ngram":
        from specserve.spec_decode.drafters.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model":
        from specserve.spec_decode.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter.from_config(config, target)
    if config.method in ("dspark", "dflash"):
        from specserve.spec_decode.drafters.dspark import DSparkDrafter

        return DSparkDrafter.from_config(config, target)
    if config.method == "eagle3":
        from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter.from_config(config, target)
    if config.method == "mtp" and config.model:
        from specserve.spec_decode.drafters.gemma4_assistant import Gemma4AssistantDrafter

        return Gemma4AssistantDrafter.from_config(config, target)
    if config.method == "mtp":
        from specserve.spec_decode.drafters.mtp import MTPDrafter

        return MTPDrafter.from_config(config, target)
    raise ValueError(f"no drafter for method {config.method!r}")


__all__ = ["Drafter", "build_drafter"]

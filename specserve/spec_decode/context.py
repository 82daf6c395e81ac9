"""What speculative decoding knows of the engine it serves, handed over explicitly: drafters, planners and
the cost profiler are built from this, never from the engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specserve.models.base import CausalLM
from specserve.platform import CPU, Platform


@dataclass(frozen=True)
class TargetContext:
    model: CausalLM  # drafters may share its embedding and LM head, and read its layers' features
    model_config: Any  # the target's text config
    tokenizer: Any | None
    model_name: str
    model_dir: str  # the resolved checkpoint directory (MTP reads its mtp.* tensors there)
    dtype: str  # "float32" | "bfloat16" | "float16"
    block_size: int  # tokens per KV block, which drafters' own paged caches use too
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator  # unseeded requests draw from the engine's generator
    tensor_parallel_size: int = 1  # ranks the target is split over (its runner's cost depends on it)
    platform: Platform = CPU  # where the target runs: drafters load onto it and draw on its device
    load_format: str = "auto"  # the target's; "dummy" makes a draft model's weights random too (as vLLM)
    enforce_eager: bool = False  # no CUDA graphs, the drafter's forwards included

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

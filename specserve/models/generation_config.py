"""What a model's files say about generating with it: the ids that end a generation, its context length."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MAX_MODEL_LEN = 8192  # when the config names no context length; also the default cap


def eos_token_ids(model_dir: Path, model_config, tokenizer) -> frozenset[int]:
    """Every id that ends a generation: generation_config.json's eos list, the config's, the tokenizer's."""
    path = model_dir / "generation_config.json"
    generation_config = json.loads(path.read_text()) if path.exists() else {}
    ids: set[int] = set()
    for source in (generation_config.get("eos_token_id"), getattr(model_config, "eos_token_id", None)):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def context_length(model_config) -> int:
    return getattr(model_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN

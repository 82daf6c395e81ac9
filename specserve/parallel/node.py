"""Where a tensor-parallel rank runs within its node. A launcher such as torchrun says (LOCAL_RANK,
LOCAL_WORLD_SIZE: several nodes each run some of the ranks); the engine's own workers all run on its node,
rank r being its local rank r."""

from __future__ import annotations

import os


def local_rank(rank: int) -> int:
    return int(os.environ.get("LOCAL_RANK", rank))


def local_world_size(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

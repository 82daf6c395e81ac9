"""A model's weight tensors, and moving them to other storage with the sharing between them kept.

Quantized models share storage between tensors: a fused projection's members view its layer's buffers
(layers/fusion.py), stacked experts' layers view the stack (layers/moe.py). `model.to(device)` copies each
tensor on its own, which would hold such weights twice on the device and leave the stacks' own references
behind on the host; `move_storages` copies each storage once and re-points every tensor on it in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

ALIGN = 16  # bytes: a moved span starts at a multiple of every element size


def weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of `model`'s modules and of their fused projections' layers (which are
    not submodules), each once."""
    seen: set[int] = set()
    for module in model.modules():
        fusion = getattr(module, "fusion", None)
        for owner in (module,) if fusion is None else (module, fusion.layer):
            for t in (*owner._parameters.values(), *owner._buffers.values()):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield t


def _extent(t: torch.Tensor) -> int:
    """Elements from t's first to one past its last, in its storage."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))


@torch.no_grad()
def move_storages(tensors: list[torch.Tensor], copy: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Point each of `tensors` at `copy`'s copy of its storage (a uint8 span of it: the bytes its tensors
    use, so a large file mapping is not copied whole), in place (`.data`): views of one storage stay views
    of one copy, and every holder of a tensor sees it moved. `copy`: e.g. `lambda span: span.to("cuda")`."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.numel():
            storage = t.untyped_storage()
            groups.setdefault(storage._cdata, (storage, []))[1].append(t)
        else:
            t.data = copy(t)
    for storage, held in groups.values():
        starts = [t.storage_offset() * t.element_size() for t in held]
        ends = [s + _extent(t) * t.element_size() for s, t in zip(starts, held, strict=True)]
        first = min(starts) // ALIGN * ALIGN
        span = copy(torch.empty(0, dtype=torch.uint8).set_(storage)[first : max(ends)])
        for t, start in zip(held, starts, strict=True):
            offset = (span.storage_offset() + start - first) // t.element_size()
            moved = torch.empty(0, dtype=t.dtype, device=span.device)
            t.data = moved.set_(span.untyped_storage(), offset, t.shape, t.stride())

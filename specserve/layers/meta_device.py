"""Building modules on the meta device without running their initializers.

A skeleton on the meta device has shapes and no values, so its initializers compute nothing; but on meta,
torch routes `nn.init.normal_` and its kin through its compiler stack, whose import (torch._dynamo) also
imports Triton where it is installed: a second or two at every load, and Triton's bindings print leak
warnings when the process exits. `on_meta()` answers those initializers before torch runs them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

INITIALIZERS = frozenset(
    getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")
)


class _SkipInitializers(TorchFunctionMode):
    """Returns the tensor an `nn.init` initializer was given, untouched (a per-thread mode, like torch's
    device context it sits on)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in INITIALIZERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`with on_meta(): model = Model(config)`: the modules on the meta device, their initializers skipped."""
    with torch.device("meta"), _SkipInitializers():
        yield

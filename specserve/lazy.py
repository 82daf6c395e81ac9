"""Package attributes that import their module on first use (PEP 562), so that importing a package (for
`specserve --help`, say) does not import torch and the engine behind its public names."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: `exports` maps each public name to the module defining it."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__

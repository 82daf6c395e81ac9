"""Where specserve keeps what it builds once and reuses (assembled and converted models, cost profiles)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root() -> Path:
    """`$SPECSERVE_CACHE`, or `~/.cache/specserve`."""
    env = os.environ.get("SPECSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specserve"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two processes never build the same thing at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

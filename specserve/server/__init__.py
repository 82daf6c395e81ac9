"""OpenAI-compatible HTTP server: FastAPI routes over an engine loop on a background thread.

The names load on first use: `specserve serve --help` parses its flags without importing the server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.lazy import lazy_exports

_EXPORTS = {
    "AsyncEngine": "specserve.server.async_engine",
    "build_app": "specserve.server.app",
    "serve": "specserve.server.launch",
}
__all__ = ["AsyncEngine", "build_app", "serve"]
__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from specserve.server.app import build_app
    from specserve.server.async_engine import AsyncEngine
    from specserve.server.launch import serve

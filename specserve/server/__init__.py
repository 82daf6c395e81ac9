"""OpenAI-compatible HTTP server: FastAPI routes over an engine loop on a background thread."""

from specserve.server.app import build_app
from specserve.server.async_engine import AsyncEngine
from specserve.server.launch import serve

__all__ = ["AsyncEngine", "build_app", "serve"]

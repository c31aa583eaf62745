"""Serving: the async engine and the OpenAI-compatible HTTP server (``turbospec serve``)."""
from .async_engine import AsyncEngine, QueueFullError, StreamDelta

__all__ = ["AsyncEngine", "QueueFullError", "StreamDelta"]

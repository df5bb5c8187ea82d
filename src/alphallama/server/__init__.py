"""OpenAI-compatible HTTP server over one engine: `create_app(settings, load)`.

Module map: app (factory, API key, /health, /metrics), routes (the /v1 endpoints),
schemas (request bodies), responses (response and chunk shapes), worker (the engine's
thread and its FIFO queue), textstream (detokenization and stop strings), streaming
(SSE and disconnects), errors (OpenAI's error shape), metrics, state, cli.
"""
from .app import create_app
from .state import ServerSettings

__all__ = ["create_app", "ServerSettings"]

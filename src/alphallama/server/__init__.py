"""OpenAI-compatible HTTP server over one engine: `create_app(settings, load)`.

Module map: app (factory, API key, /health, /metrics), routes (the /v1 endpoints),
schemas (request bodies), responses (response and chunk shapes), worker (the engine's
thread and its FIFO queue), textstream (detokenization and stop strings), streaming
(SSE and disconnects), errors (OpenAI's error shape), metrics, state, cli. llama-server's
own routes: llama_routes (/props, /slots, /tokenize, /detokenize, /apply-template),
native_completion (/completion), embeddings (/v1/embeddings, /embeddings), llama_schemas
(their bodies), calls (engine work queued behind generations); webui serves web/index.html at /.
"""
from .app import create_app
from .state import ServerSettings

__all__ = ["create_app", "ServerSettings"]

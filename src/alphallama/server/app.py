"""The app factory: `create_app(settings, load)` -> a FastAPI app serving one engine.

The HTTP server answers from the first moment; the model loads in the engine's worker
thread meanwhile (GET /health says 503 until it is ready). Everything the app needs
lives in its own AppState (`app.state.alpha`): two apps in one process share nothing.
"""
from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import Engine
from .cors import add_cors
from .embeddings import router as embeddings_router
from .errors import APIError, install_handlers
from .llama_routes import router as llama_router
from .metrics import Metrics
from .native_completion import router as native_completion_router
from .response_schemas import Health, error_responses, install_openapi
from .routes import router
from .state import AppState, ServerSettings, app_state
from .webui import router as webui_router
from .worker import EngineWorker

# Reachable without the API key: liveness probes, the API's own documentation and the chat
# page (which asks for the key itself).
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/"})


class _Guard:
    """ASGI middleware run before routing: the API key (401), the body size (413), and
    POST bodies read as JSON.

    It checks the key before the body is even read, so a request with a bad key is
    answered 401 whatever else is wrong with it."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key and scope["path"] not in PUBLIC_PATHS and not self._key_ok(headers):
            error = APIError("authentication", "invalid or missing API key (send 'Authorization: Bearer KEY')",
                             code="invalid_api_key")
            return await error.response()(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._too_large().response()(scope, receive, send)
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # Every body this API takes is JSON, and OpenAI and llama-server read it as
            # such whatever the Content-Type says (`curl -d` sends a form type).
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        seen = 0

        async def counted() -> Message:   # bodies without a Content-Length are counted as they come
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:   # an HTTPException passes through FastAPI's body reading as is
                raise HTTPException(413, self._too_large().message)
            return message
        await self.app(scope, counted, send)

    def _key_ok(self, headers: Headers) -> bool:
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def _too_large(self) -> APIError:
        return APIError("too_large", f"the request body is larger than {self.max_body} bytes")


def create_app(settings: ServerSettings, load: Callable[[], Engine] | Engine,
               on_load_failed: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`load` builds the engine in the worker thread (or is an engine already loaded);
    `on_load_failed` lets the CLI stop the server when the model cannot be loaded."""
    metrics = Metrics()
    loader = (lambda: load) if isinstance(load, Engine) else load
    worker = EngineWorker(loader, settings.spec, settings.queue_size, metrics,
                          retry_after_s=settings.retry_after_s, on_load_failed=on_load_failed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        # The first run_in_threadpool imports anyio's asyncio backend and starts its thread
        # (~0.1 s on a 2-core CPU, ~20 ms on the H200's host): paid here, while the model
        # loads, not by the first request.
        await run_in_threadpool(lambda: None)
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="AlphaLlama", summary="OpenAI-compatible server for one local model",
                  version="0.1.0", lifespan=lifespan)
    app.state.alpha = AppState(settings, worker, metrics)
    install_handlers(app)
    app.include_router(router, prefix="/v1")
    app.include_router(router, include_in_schema=False)   # llama-server answers without /v1 too
    for extra in (llama_router, native_completion_router, embeddings_router, webui_router):   # llama-server's own
        app.include_router(extra)

    @app.get("/health", summary="200 once the model is loaded, 503 before", response_model=Health,
             responses=error_responses(503))
    async def health(request: Request):
        w = app_state(request).worker
        if w.state == "ready":
            return {"status": "ok"}
        return APIError("unavailable", w.unavailable_reason()).response()

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
             responses=error_responses(401))
    async def prometheus(request: Request):
        st = app_state(request)
        text = st.metrics.render(st.worker.queue_depth, st.worker.processing, st.worker.state == "ready",
                                 st.worker.store_figures())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    install_openapi(app)
    app.add_middleware(_Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    # Browser chat UIs on local pages (or --cors-origins) may call. Added last, so it runs
    # first: preflight requests carry no API key and must not meet the guard.
    add_cors(app, settings.cors_origins)
    return app

"""GET /: the chat page (server/web/index.html, package data: one static file, no build
step, nothing from a CDN). It is public, as llama-server's web UI is: the page asks for the
API key itself when /props answers 401."""
from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()
PAGE = ("web", "index.html")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    page = files("alphallama.server").joinpath(*PAGE).read_text(encoding="utf-8")
    # the page talks to this server only (it fetches nothing else)
    return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; "
                                       "script-src 'unsafe-inline'; style-src 'unsafe-inline'",
                                       "Cache-Control": "no-cache"})

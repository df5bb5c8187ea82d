"""Which web pages may call the server from a browser (CORS).

Without an API key anything that can reach the port may use it; a browser adds every web
site the user visits to that list, unless the server refuses their origins. So by default
only local pages are answered, as Ollama does: http(s) on localhost, 127.0.0.1, [::1] or
0.0.0.0 at any port, and the schemes of desktop and editor apps (app://, file://,
tauri://, vscode-webview://, vscode-file://). `--cors-origins` adds origins, or `*` for all
(llama-server's behaviour, for a server meant to be called from anywhere).
"""
from __future__ import annotations

import argparse
import re

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

LOCAL_ORIGINS = (r"https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d{1,5})?"
                 r"|(app|file|tauri|vscode-webview|vscode-file)://[^\s]*")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", re.IGNORECASE)


def parse_origins(text: str) -> tuple[str, ...]:
    """`--cors-origins`: comma-separated origins (scheme://host[:port], no path), or `*`."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    bad = [o for o in origins if o != "*" and not _ORIGIN.fullmatch(o)]
    if bad or not origins:
        raise argparse.ArgumentTypeError(f"not an origin (scheme://host[:port], or *): {', '.join(bad) or text!r}")
    return origins


def add_cors(app: FastAPI, extra_origins: tuple[str, ...]) -> None:
    """The local origins, plus `extra_origins` (all origins when it holds `*`)."""
    if "*" in extra_origins:
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    else:
        app.add_middleware(CORSMiddleware, allow_origins=list(extra_origins), allow_origin_regex=LOCAL_ORIGINS,
                           allow_methods=["*"], allow_headers=["*"])

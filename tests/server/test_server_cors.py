"""CORS: by default only local pages may call from a browser (as Ollama); --cors-origins
widens it. The app is driven in-process: CORS is decided before any model is needed."""
from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from alphallama.server import ServerSettings, create_app
from alphallama.server.cors import parse_origins

LOCAL = ["http://localhost", "http://localhost:3000", "https://127.0.0.1:8443", "http://[::1]:5173",
         "http://0.0.0.0:8080", "app://obsidian.md", "file://", "tauri://localhost", "vscode-webview://abc"]
FOREIGN = ["https://evil.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example:80",
           "null", "http://192.168.1.10:3000", "https://localhost:3000/path", "chrome-extension://abc"]


def client(*origins: str) -> TestClient:
    # no `with`: the lifespan (the engine's worker) is not started, and never needed here
    return TestClient(create_app(ServerSettings(model_names=("m",), cors_origins=origins), lambda: None))


def preflight(c: TestClient, origin: str):
    return c.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def allowed(c: TestClient, origin: str) -> tuple[str | None, str | None]:
    """The Access-Control-Allow-Origin of a preflight and of a simple request."""
    return (preflight(c, origin).headers.get("access-control-allow-origin"),
            c.get("/v1/models", headers={"Origin": origin}).headers.get("access-control-allow-origin"))


@pytest.mark.parametrize("origin", LOCAL)
def test_local_origins_are_answered(origin):
    assert allowed(client(), origin) == (origin, origin)


@pytest.mark.parametrize("origin", FOREIGN)
def test_foreign_origins_get_no_allow_origin(origin):
    c = client()
    assert allowed(c, origin) == (None, None)
    assert preflight(c, origin).status_code == 400
    assert c.get("/v1/models", headers={"Origin": origin}).status_code == 200   # not a browser: no CORS


def test_the_flag_widens():
    c = client("https://ui.example", "http://192.168.1.10:3000")
    assert allowed(c, "https://ui.example") == ("https://ui.example",) * 2
    assert allowed(c, "http://192.168.1.10:3000") == ("http://192.168.1.10:3000",) * 2
    assert allowed(c, "http://localhost:3000") == ("http://localhost:3000",) * 2   # local ones stay
    assert allowed(c, "https://evil.example") == (None, None)
    assert set(allowed(client("*"), "https://evil.example")) <= {"*", "https://evil.example"}
    assert None not in allowed(client("*"), "https://evil.example")


def test_cors_origins_parsing():
    assert parse_origins("https://a.example, http://b.example:8080/") == ("https://a.example",
                                                                         "http://b.example:8080")
    assert parse_origins("*") == ("*",)
    for bad in ("", "a.example", "https://a.example/path", "https://", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_origins(bad)


def test_serve_cli_has_the_flag():
    from alphallama.server.cli import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--cors-origins", "https://ui.example,*"])
    assert args.cors_origins == ("https://ui.example", "*")
    assert p.parse_args([]).cors_origins == ()

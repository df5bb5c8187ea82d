"""A scripted OpenAI-compatible server: real HTTP (chunked SSE), tokens on a
schedule, llama-server style `timings`, and scripted failures. It tests the arena
harness and gives `alphallama bench` a dry run without a model:

    python -m alphallama.bench.stub --port 8099 [--script S.json] [--log requests.jsonl]

Script (JSON), every key optional:
    {"model": "stub", "startup_delay_s": 0,          # /health is 503 until then
     "default": SPEC,
     "responses": {"<last message content>": [SPEC for its 1st request, 2nd, ...]}}
SPEC: {"tokens": 8, "ttft_ms": 5, "token_ms": 1,     # first text chunk after ttft_ms,
       "chunk_tokens": 1,                             # then one chunk every token_ms
       "timings": {...} | "auto" | null,              # sent as-is in the final chunk
       "fail": null | "close" | "exit" | "hang" | "http500", "fail_after": 0}
A prompt's later requests reuse its last SPEC. Failures: "close" cuts the connection
after `fail_after` text chunks, "exit" ends the whole server there (in a thread:
closes it), "hang" stops sending and holds the connection open.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

SPEC_DEFAULTS: dict[str, Any] = {"tokens": 8, "ttft_ms": 5.0, "token_ms": 1.0, "chunk_tokens": 1,
                                 "timings": "auto", "fail": None, "fail_after": 0}


class _Cut(Exception):
    """Raised inside a handler to drop the connection without finishing the body."""


class StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], script: dict[str, Any], log_path: str | None,
                 on_exit: Callable[["StubServer"], None]) -> None:
        super().__init__(addr, _Handler)
        self.script = script
        self.log_path = log_path
        self.on_exit = on_exit
        self.born = time.monotonic()
        self.requests: list[dict[str, Any]] = []     # in arrival order
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def record(self, body: dict[str, Any]) -> dict[str, Any]:
        """Log the request; return the SPEC for it."""
        messages = body.get("messages") or [{}]
        content = str(messages[-1].get("content", ""))
        with self._lock:
            nth = self._seen.get(content, 0)
            self._seen[content] = nth + 1
            entry = {"content": content, "nth": nth, "t": time.time(),
                     **{k: body.get(k) for k in ("model", "max_tokens", "temperature", "seed",
                                                 "stream", "stream_options")}}
            self.requests.append(entry)
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
        specs = (self.script.get("responses") or {}).get(content)
        chosen = specs[min(nth, len(specs) - 1)] if specs else self.script.get("default") or {}
        return {**SPEC_DEFAULTS, **chosen}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StubServer

    def setup(self) -> None:
        super().setup()
        # Without TCP_NODELAY, Nagle's algorithm holds back small SSE chunks and the
        # client clock would measure the TCP stack, not the script.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args: Any) -> None:   # keep test output clean
        pass

    def _json(self, status: int, doc: Any) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        model = self.server.script.get("model", "stub")
        ready = time.monotonic() - self.server.born >= self.server.script.get("startup_delay_s", 0)
        routes = {
            "/health": (200, {"status": "ok"}) if ready else (503, {"status": "loading"}),
            "/v1/models": (200, {"object": "list", "data": [{"id": model, "object": "model"}]}),
            "/props": (200, {"build_info": "alphallama-stub", "model_path": model}),
            "/stub/requests": (200, self.server.requests),
        }
        self._json(*routes.get(self.path, (404, {"error": "not found"})))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": "not found"})
        spec = self.server.record(body)
        if spec["fail"] == "http500":
            return self._json(500, {"error": {"message": "scripted failure"}})
        try:
            self._stream(body, spec)
        except (_Cut, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _send(self, data: str) -> None:
        raw = data.encode()
        self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
        self.wfile.flush()

    def _event(self, obj: Any) -> None:
        self._send("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n")

    def _stream(self, body: dict[str, Any], spec: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": body.get("model")}
        self._event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        t0 = time.monotonic()
        n, per = int(spec["tokens"]), max(1, int(spec["chunk_tokens"]))
        for i, first in enumerate(range(0, n, per)):
            if spec["fail"] and i == spec["fail_after"]:
                self._fail(spec["fail"])
            # Absolute schedule, so sleep overshoot does not accumulate over a stream.
            due = t0 + (spec["ttft_ms"] + i * spec["token_ms"]) / 1000.0
            time.sleep(max(0.0, due - time.monotonic()))
            text = "".join(f"t{j} " for j in range(first, min(n, first + per)))
            self._event({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
        if spec["fail"]:
            self._fail(spec["fail"])
        final: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        timings = spec["timings"]
        if timings == "auto":
            timings = {"prompt_n": 10, "prompt_ms": float(spec["ttft_ms"]), "predicted_n": n,
                       "predicted_ms": max(n - 1, 1) * float(spec["token_ms"])}
            timings["predicted_per_second"] = n / timings["predicted_ms"] * 1000.0
        if timings:
            final["timings"] = timings
        self._event(final)
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": n,
                                                           "total_tokens": 10 + n}})
        self._event("[DONE]")
        self._send("")   # the zero-length chunk ends the body

    def _fail(self, how: str) -> None:
        if how == "hang":
            self.server.stopping.wait(3600)
        elif how == "exit":
            self.server.on_exit(self.server)
        raise _Cut()


def _exit_process(server: StubServer) -> None:
    os._exit(3)   # a crash: no cleanup, no response end


def _close_server(server: StubServer) -> None:
    """In-thread stand-in for a crash: stop listening, so the next request is refused."""
    server.stopping.set()
    server.shutdown()        # called from a handler thread, so it cannot deadlock
    server.server_close()


@contextmanager
def serve_in_thread(script: dict[str, Any] | None = None, log_path: str | None = None) -> Iterator[StubServer]:
    server = StubServer(("127.0.0.1", 0), script or {}, log_path, _close_server)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m alphallama.bench.stub", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--script", help="JSON script file")
    p.add_argument("--log", help="append every request as a JSON line")
    args = p.parse_args(argv)
    script = json.load(open(args.script)) if args.script else {}
    server = StubServer((args.host, args.port), script, args.log, _exit_process)
    print(f"stub listening on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real servers for the tests: uvicorn on a free loopback port, in a thread, with a real
engine behind it, and the fixtures that start them.

Test modules import the fixtures they use from here. (Not a conftest.py: the test
modules of other folders import `conftest` by name and must get tests/conftest.py.)"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import uvicorn
from openai import OpenAI

from alphallama.engine import Engine
from alphallama.server import ServerSettings, create_app
from conftest import VOCAB

API_KEY = "test-key"
QWEN2_VOCAB_NAME = "ggml-vocab-qwen2.gguf"


class Running:
    """A server started by `serve`: its URL, app and an openai client for it."""

    def __init__(self, server: uvicorn.Server, app, base: str):
        self.server, self.app, self.base = server, app, base
        self.url = base + "/v1"

    @property
    def state(self):
        return self.app.state.alpha

    headers = {"Authorization": f"Bearer {API_KEY}"}

    def client(self, api_key: str = API_KEY, **kw) -> OpenAI:
        return OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=60, **kw)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.state.worker.state != "ready":
            assert self.state.worker.state == "loading", self.state.worker.load_error
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.02)


@contextmanager
def serve(load: Callable[[], Engine] | Engine, model_path: Path, wait: bool = True, **settings) -> Iterator[Running]:
    settings.setdefault("api_key", API_KEY)
    app = create_app(ServerSettings(model_names=ServerSettings.names_for(str(model_path)), **settings), load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                             timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = Running(server, app, f"http://127.0.0.1:{port}")
    try:
        if wait:
            running.wait_ready()
        yield running
    finally:
        server.should_exit = True
        thread.join(15)


def wait_healthy(proc, port: int, timeout: float, why: Callable[[], str]) -> None:
    """Poll a `serve` subprocess's /health until 200; fail with why() if it exits or times out."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, why()
        assert time.monotonic() < deadline, "the server did not become healthy"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # The tiny models decode ~20x faster on one thread than on two busy cores. Per module,
    # so tests outside this folder keep their thread count.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def qwen_path(tmp_path_factory) -> Path:
    """A one-layer random-weight qwen3 with the real Qwen2 tokenizer and its ChatML template."""
    vocab = VOCAB / QWEN2_VOCAB_NAME   # ../shared (tests/conftest.py): its tests are marked `shared`
    if not vocab.exists():
        pytest.skip(f"{vocab} is not present")
    from alphallama.gguf.writer import PRESETS, write_synthetic
    path = tmp_path_factory.mktemp("models") / "tiny-qwen3.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](vocab_from=str(vocab), quant="Q8_0", n_layers=1, seed=3), path)
    return path


@pytest.fixture(scope="module")
def stories_server(stories_path) -> Iterator[Running]:
    with serve(lambda: Engine.load(str(stories_path)), stories_path) as s:
        yield s

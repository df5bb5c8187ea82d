"""One engine, one user: FIFO queueing, 429 when the queue is full, disconnects that
cancel at once, and the start-up window while the model loads."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from alphallama.engine import Engine
from alphallama.gguf.reader import GGUFError

from serverutil import _one_torch_thread, serve  # noqa: F401

MODEL = "stories260K.gguf"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def engine(stories_path):
    # One engine shared by this module's servers, which run one after another.
    return Engine.load(str(stories_path))


def metric(server, name: str) -> float:
    text = httpx.get(server.base + "/metrics", headers=server.headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("alphallama_" + name))


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_clients_are_served_in_arrival_order(engine, stories_path, monkeypatch):
    runs: list[tuple[int, float, float]] = []   # (prompt length, start, end) as the engine ran them
    generate = engine.generate

    def recorded(prompt_ids, *a, **kw):
        start = time.monotonic()
        try:
            yield from generate(prompt_ids, *a, **kw)
        finally:
            runs.append((len(prompt_ids), start, time.monotonic()))
    monkeypatch.setattr(engine, "generate", recorded)
    prompts = {name: PROMPT + " and" * i for i, name in enumerate("ABCD")}   # told apart by length
    with serve(engine, stories_path) as server:
        first_chunk: dict[str, float] = {}

        def run(name: str, n: int, first: threading.Event | None = None) -> None:
            stream = server.client().completions.create(model=MODEL, prompt=prompts[name], max_tokens=n,
                                                        stream=True)
            for chunk in stream:
                first_chunk.setdefault(name, time.monotonic())
                if first is not None:
                    first.set()

        started = threading.Event()
        threads = [threading.Thread(target=run, args=("A", 400, started))]
        threads[0].start()
        assert started.wait(20)
        for name in "BCD":                 # arrive in this order while A generates
            threads.append(threading.Thread(target=run, args=(name, 30)))
            threads[-1].start()
            wait_for(lambda: server.state.worker.queue_depth == len(threads) - 1)
        assert metric(server, "queue_depth") == 3 and metric(server, "requests_processing") == 1
        for t in threads:
            t.join(60)
        assert sorted(first_chunk, key=first_chunk.get) == list("ABCD")
    lengths = {len(engine.encode_prompt(p)): name for name, p in prompts.items()}
    assert [lengths[n] for n, _, _ in runs] == list("ABCD")
    for (_, _, end), (_, start, _) in zip(runs, runs[1:]):   # one at a time, never overlapping
        assert end <= start


def test_disconnect_mid_stream_cancels_and_the_next_request_proceeds(engine, stories_path):
    with serve(engine, stories_path) as server:
        before = metric(server, "tokens_predicted_total")
        stream = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1800, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        r = server.client().completions.create(model=MODEL, prompt="Tom had a dog", max_tokens=5)
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        assert metric(server, 'requests_total{endpoint="completions",outcome="cancelled"}') == 1
        # The cancelled generation stopped right away, far short of its 1800 tokens.
        assert metric(server, "tokens_predicted_total") - before - 5 < 400


def test_disconnect_while_waiting_for_a_whole_response(engine, stories_path):
    with serve(engine, stories_path) as server:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1800}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/completions", json=body, headers=server.headers, timeout=0.3)
        wait_for(lambda: metric(server, 'requests_total{endpoint="completions",outcome="cancelled"}') == 1)
        r = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert r.usage.completion_tokens == 4


def test_a_waiting_stream_that_disconnects_leaves_the_queue(engine, stories_path):
    with serve(engine, stories_path) as server:
        client = server.client()
        running = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1800, stream=True)
        next(iter(running))
        waiting = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True)
        assert server.state.worker.queue_depth == 1     # headers came back; it waits for the engine
        waiting.close()
        wait_for(lambda: server.state.worker.queue_depth == 0)
        assert metric(server, 'requests_total{endpoint="completions",outcome="cancelled"}') == 1
        running.close()


def test_full_queue_answers_429_with_retry_after(engine, stories_path):
    with serve(engine, stories_path, queue_size=1) as server:
        client = server.client()
        running = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1800, stream=True)
        next(iter(running))
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.append(
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)))
        waiter.start()
        wait_for(lambda: server.state.worker.queue_depth == 1)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.response.json()["error"]["type"] == "rate_limit_error"
        running.close()                    # frees the engine; the waiting request runs
        waiter.join(30)
        assert waited and waited[0].usage.completion_tokens == 3


def test_health_is_503_while_loading(engine, stories_path):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return engine
    with serve(slow_load, stories_path, wait=False) as server:
        r = httpx.get(server.base + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        with pytest.raises(openai.APIStatusError) as e:
            server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503 and "loading" in e.value.message
        assert metric(server, "model_loaded") == 0
        release.set()
        server.wait_ready()
        assert httpx.get(server.base + "/health").json() == {"status": "ok"}
        assert server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage


def test_a_model_that_fails_to_load_is_reported(stories_path):
    def broken():
        raise GGUFError("broken.gguf: not a GGUF file")
    with serve(broken, stories_path, wait=False) as server:
        wait_for(lambda: server.state.worker.state == "failed")
        r = httpx.get(server.base + "/health")
        assert r.status_code == 503 and "not a GGUF file" in r.json()["error"]["message"]


def test_an_engine_failure_is_a_500_and_the_server_goes_on(engine, stories_path, monkeypatch):
    generate = engine.generate

    def failing(prompt_ids, *a, **kw):
        it = generate(prompt_ids, *a, **kw)
        yield next(it)
        it.close()
        raise RuntimeError("simulated device fault")
    with serve(engine, stories_path) as server:
        client = server.client()
        monkeypatch.setattr(engine, "generate", failing)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        assert "simulated device fault" in e.value.message
        with pytest.raises(openai.APIError, match="simulated device fault"):   # in the stream: headers were sent
            list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
        monkeypatch.setattr(engine, "generate", generate)
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        assert r.usage.completion_tokens == 5
        assert r.model_extra["timings"]["prompt_n"] == 5   # the cache was not trusted after the fault

"""Hostile input to the server (issue 29): a hostile chat template in the model, prompts too
long for any context, sampling parameters at the edges of float32, browser requests from
other web sites, any model name. Each gets a 4xx or a real answer, never a 5xx, and the
server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from alphallama.chat import ChatTemplate, RenderBudget
from alphallama.engine import Engine
from alphallama.server import ServerSettings, create_app

from serverutil import _one_torch_thread, serve  # noqa: F401  (tests/server/serverutil.py)

MODEL = "stories260K.gguf"
HI = [{"role": "user", "content": "hi"}]
SMALL = RenderBudget(seconds=0.3, max_chars=64 << 10)
HOSTILE = {   # the three of issue 29: a hang, a SIGABRT in the tokenizer, 3.4 GB of memory
    "nested range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge string": "{{ 'a' * 10**8 }}",
    "doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s }}",
}


@pytest.fixture(scope="module")
def server(stories_path):
    with serve(lambda: Engine.load(str(stories_path)), stories_path) as s:
        yield s


def no_500(server) -> None:
    metrics = httpx.get(server.base + "/metrics", headers=server.headers).text
    assert "error_500" not in metrics


def test_hostile_chat_templates_are_400_and_the_server_keeps_serving(stories_path):
    engine = Engine.load(str(stories_path))
    with serve(engine, stories_path) as s:
        client = s.client()
        for name, source in HOSTILE.items():
            engine.chat_template = ChatTemplate(source, budget=SMALL)
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
            err = e.value.response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == "messages"
            assert "chat template" in err["message"] and "budget" in err["message"], (name, err)
            with pytest.raises(openai.BadRequestError):   # streamed: refused before the stream starts
                client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=True)
            # the server is fine: a plain completion, then a chat with a sane template
            assert client.completions.create(model=MODEL, prompt="Once", max_tokens=2).usage.completion_tokens == 2
        engine.chat_template = ChatTemplate.from_gguf_metadata(engine.gguf.metadata)
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert r.usage.completion_tokens == 2
        no_500(s)


def test_prompt_text_too_long_for_any_context_is_refused_before_tokenizing(server):
    engine = server.state.worker.engine
    n = engine.max_prompt_chars + 1
    assert n > engine.ctx_size * engine.tokenizer.max_piece_bytes   # more than any context-full of tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="a" * n, max_tokens=2)
    err = e.value.response.json()["error"]
    assert err["code"] == "context_length_exceeded" and f"{n} characters" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a" * n}],
                                                max_tokens=2)
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded"


VALID_SAMPLING = [
    dict(top_p=1e-46), dict(top_p=5e-324), dict(top_p=1.0), dict(top_p=0.999999),
    dict(temperature=0.0), dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1.7e308),
    dict(temperature=1e-9, top_p=1e-46, min_p=1.0), dict(min_p=0.0), dict(min_p=1.0), dict(min_p=5e-324),
    dict(top_k=0), dict(top_k=1), dict(top_k=2), dict(top_k=2 ** 62), dict(top_k=10 ** 30),
    dict(seed=-(2 ** 63)), dict(seed=2 ** 64 - 1), dict(seed=0),
    dict(temperature=2.0, top_k=5, top_p=0.5, min_p=0.5),
]
INVALID_SAMPLING = [
    dict(top_p=0.0), dict(top_p=-1e-300), dict(top_p=1.0000001), dict(temperature=-5e-324), dict(min_p=-1e-300),
    dict(min_p=1.5), dict(top_k=-1), dict(seed=2 ** 64), dict(temperature="1"), dict(top_p=None, top_k=1.5),
]


@pytest.mark.parametrize("max_tokens", [10 ** 30, 2 ** 63, 2 ** 64 + 5])
def test_huge_max_tokens_stop_at_the_context(server, max_tokens):
    engine = server.state.worker.engine
    prompt = engine.encode_prompt("hello " * engine.ctx_size)[:engine.ctx_size - 4]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_k": 10 ** 40}
    r = httpx.post(server.url + "/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"] <= engine.ctx_size
    assert done["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("kw", VALID_SAMPLING, ids=str)
def test_every_valid_sampling_value_is_served(server, kw):
    # seeded: at temperature 1.7e308 every one of the 512 tokens is as likely, the end token too,
    # and an unseeded draw ended at once about 1 time in 250 (session 51's CI)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0.8, "seed": 11} | kw
    r = httpx.post(server.url + "/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("kw", INVALID_SAMPLING, ids=str)
def test_out_of_range_sampling_is_400(server, kw):
    body = {"model": MODEL, "messages": HI, "max_tokens": 2} | kw
    r = httpx.post(server.url + "/chat/completions", json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in kw
    no_500(server)


def test_any_model_name_is_served_and_models_names_the_file(server):
    client = server.client()
    for name in ("gpt-4o", "", "stories260K", "../../etc/passwd"):
        assert client.completions.create(model=name, prompt="Once", max_tokens=2).model == MODEL
    assert [m.id for m in client.models.list()] == [MODEL]


def test_models_names_the_alias(stories_path):
    app = create_app(ServerSettings(model_names=ServerSettings.names_for(str(stories_path), "my-model")),
                     lambda: Engine.load(str(stories_path)))
    assert [m["id"] for m in TestClient(app).get("/v1/models").json()["data"]] == ["my-model"]

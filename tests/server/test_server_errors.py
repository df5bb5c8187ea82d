"""Every client mistake gets OpenAI's error shape and a 4xx status, and the server keeps
serving afterwards."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from alphallama.engine import Engine

from serverutil import _one_torch_thread, serve  # noqa: F401  (tests/server/serverutil.py)

MODEL = "stories260K.gguf"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(stories_path):
    with serve(lambda: Engine.load(str(stories_path)), stories_path, max_body_bytes=64 * 1024) as s:
        yield s


def error_of(exc_info) -> dict:
    body = exc_info.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def raw(server, body: bytes | str, path: str = "/chat/completions", **kw) -> httpx.Response:
    return httpx.post(server.url + path, content=body, headers=server.headers, **kw)


@pytest.mark.parametrize("body", [b'{"messages": [{"role": "user", "content": "hi"', b"not json", b"",
                                  b"[1, 2]", b'{"messages": [], "max_tokens": 3}',
                                  b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'])
def test_malformed_bodies_are_400(server, body):
    r = raw(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens="5"), "max_tokens"),              # wrong types: no guessing
    (dict(temperature="hot"), "temperature"),
    (dict(stream="yes"), "stream"),
    (dict(stop=5), "stop"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(seed=2 ** 70), "seed"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(n=2), "n"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),   # ChatML: no tool format
    (dict(stop=[str(i) for i in range(17)]), "stop"),
    (dict(stop="x" * 1025), "stop"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
])
def test_bad_parameters_are_400(server, kw, param):
    args = {"model": MODEL, "messages": HI, "max_tokens": 2} | kw
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(**args)
    err = error_of(e)
    assert e.value.status_code == 400 and err["param"].startswith(param), err


def test_unknown_model_name_is_served(server):
    # as llama-server: one model, whatever name the client sends (issue 29)
    r = server.client().chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert r.model == MODEL and r.usage.completion_tokens == 2


def test_prompt_longer_than_the_context(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="hello " * 2500, max_tokens=2)
    err = error_of(e)
    assert err["code"] == "context_length_exceeded"
    n, limit = map(int, re.search(r"has (\d+) tokens .* holds (\d+)", err["message"]).groups())
    assert n > 2500 and limit == 2048   # says how many tokens, against what limit


@pytest.mark.parametrize("prompt", [[1, 99999], [], ["a", "b"]])
def test_bad_completion_prompts(server, prompt):
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2)


def test_bad_or_missing_api_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert error_of(e)["code"] == "invalid_api_key"
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    assert httpx.post(server.url + "/chat/completions", json=body).status_code == 401   # no key at all
    assert httpx.get(server.url + "/models").status_code == 401
    # the key is checked before the body: a bad key with a broken body is still a 401
    assert httpx.post(server.url + "/chat/completions", content=b"{").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200   # public


def test_routes_methods_and_sizes(server):
    assert httpx.get(server.url + "/nothing", headers=server.headers).json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/chat/completions", headers=server.headers).status_code == 405
    big = b'{"prompt": "' + b"a" * 70_000 + b'"}'
    assert raw(server, big, "/completions").status_code == 413

    def chunked():   # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b" " * 8192
    r = httpx.post(server.url + "/completions", content=chunked(), headers=server.headers)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2, "stop": ["\\udfff"]}'),
    ("/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'),
])
def test_lone_surrogates_in_json_are_replaced_not_fatal(server, path, body):
    r = raw(server, body, path)
    assert r.status_code == 200, r.text


def test_server_still_serves_and_never_answered_500(server):
    r = server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.usage.completion_tokens == 3
    metrics = httpx.get(server.base + "/metrics", headers=server.headers).text
    assert "error_500" not in metrics and 'outcome="error"' not in metrics

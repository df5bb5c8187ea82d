"""/openapi.json says what the server does: each route's documented responses (status and
JSON schema) match what it answers to a valid and to an invalid request, and validation
errors are 400 in the error shape, never FastAPI's 422."""
from __future__ import annotations

import json

import httpx
import pytest

from alphallama.engine import Engine

from schemacheck import problems  # tests/server/schemacheck.py
from serverutil import _one_torch_thread, serve  # noqa: F401  (tests/server/serverutil.py)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# Per route: requests that are valid, then ones that are not (a bad body, or no API key).
CASES = {
    ("post", "/v1/chat/completions"): ([CHAT, CHAT | {"logprobs": True, "top_logprobs": 2}, CHAT | {"model": "x"}],
                                       [{}, {"messages": []}, CHAT | {"top_p": 2}, CHAT | {"n": 3}, None]),
    ("post", "/v1/completions"): ([{"prompt": "Once", "max_tokens": 3}, {"prompt": [1, 2], "max_tokens": 2,
                                                                        "logprobs": 2}],
                                  [{"prompt": 5}, {"prompt": "a", "temperature": "hot"}, {"prompt": [99999]}, None]),
    ("get", "/v1/models"): ([None], ["no key"]),
    ("get", "/health"): ([None], []),
    ("get", "/metrics"): ([None], ["no key"]),
    # llama-server's own routes (server/llama_routes.py, native_completion.py, embeddings.py)
    ("get", "/props"): ([None], ["no key"]),
    ("get", "/slots"): ([None], ["no key"]),
    ("post", "/tokenize"): ([{"content": "Once"}, {"content": "á", "with_pieces": True}],
                            [{"content": 5}, {"content": [99999]}, None]),
    ("post", "/detokenize"): ([{"tokens": [1, 403]}], [{"tokens": [-1]}, None]),
    ("post", "/apply-template"): ([CHAT], [{"messages": []}, None]),
    ("post", "/completion"): ([{"prompt": "Once", "n_predict": 3}, {"prompt": [1, 2], "n_predict": 2, "n_probs": 2},
                               {"prompt": "Once", "n_predict": 2, "response_fields": ["content"]}],
                              [{"prompt": ["a", "b"]}, {"prompt": "a", "n_predict": -3}, None]),
    ("post", "/v1/embeddings"): ([{"input": "Once"}, {"input": ["a", [1, 2]], "encoding_format": "base64"}],
                                 [{"input": []}, {"input": "a", "encoding_format": "hex"}, None]),
    ("post", "/embeddings"): ([{"content": "Once"}], [{}, None]),
}


@pytest.fixture(scope="module")
def server(stories_path):
    with serve(lambda: Engine.load(str(stories_path)), stories_path) as s:
        yield s


@pytest.fixture(scope="module")
def doc(server) -> dict:
    return httpx.get(server.base + "/openapi.json").json()


def call(server, method: str, path: str, body) -> httpx.Response:
    headers = {} if body == "no key" else server.headers
    if method == "get":
        return httpx.get(server.base + path, headers=headers, timeout=60)
    if body is None:   # not JSON at all
        return httpx.post(server.base + path, content=b"{oops", headers=headers, timeout=60)
    return httpx.post(server.base + path, json=body, headers=headers, timeout=60)


def check_against_schema(doc: dict, method: str, path: str, r: httpx.Response) -> None:
    responses = doc["paths"][path][method]["responses"]
    assert str(r.status_code) in responses, f"{method} {path} answered {r.status_code}, documented {list(responses)}"
    content = responses[str(r.status_code)].get("content", {})
    if r.headers["content-type"].startswith("application/json"):
        schema = content["application/json"]["schema"]
        assert schema, f"{method} {path} {r.status_code}: no schema documented"
        assert problems(r.json(), schema, doc) == [], (method, path, r.status_code, r.text[:300])
    else:
        assert r.headers["content-type"].split(";")[0] in content, (method, path, r.headers["content-type"])


def test_every_route_is_covered(doc):
    assert {(m, p) for p, ops in doc["paths"].items() for m in ops} == set(CASES)


@pytest.mark.parametrize("route", list(CASES), ids=lambda r: f"{r[0]} {r[1]}")
def test_responses_match_the_schema(server, doc, route):
    method, path = route
    valid, invalid = CASES[route]
    for body in valid:
        r = call(server, method, path, body)
        assert r.status_code == 200, r.text
        check_against_schema(doc, method, path, r)
    for body in invalid:
        r = call(server, method, path, body)
        assert 400 <= r.status_code < 500, r.text
        check_against_schema(doc, method, path, r)


def test_validation_errors_are_documented_400_not_422(doc):
    text = json.dumps(doc)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/chat/completions", "/v1/completions"):
        err = doc["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert err == {"$ref": "#/components/schemas/ErrorBody"}
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]


def test_the_checker_finds_problems(doc):
    # the checker itself, against hand-made wrong bodies
    schema = {"$ref": "#/components/schemas/ChatCompletion"}
    assert problems({"object": "chat.completion"}, schema, doc)               # fields missing
    err = {"$ref": "#/components/schemas/ErrorBody"}
    assert problems({"error": {"message": 1, "type": "x", "param": None, "code": None}}, err, doc)
    assert problems({"error": {"message": "m", "type": "x", "param": None, "code": None}}, err, doc) == []

"""presence_penalty, frequency_penalty, logit_bias (OpenAI) and repeat_penalty, repeat_last_n
(llama-server) on every completion route, against real servers (stories260K, greedy): values
out of range are 400s naming the field, the penalties change the output, a stream carries
the same text as the whole answer, a speculative server gives the plain server's tokens, and
the server's flags are the defaults a request overrides."""
from __future__ import annotations

import json

import httpx
import pytest

from alphallama.engine import Engine
from alphallama.sampling import SamplingParams
from alphallama.spec.config import SpecConfig
from serverutil import _one_torch_thread, serve, stories_server  # noqa: F401  (fixtures)

PROMPT = "Once upon a time"
N = 48
ROUTES = ["/v1/chat/completions", "/v1/completions", "/completion"]
PENALIZED = [{"repeat_penalty": 1.5},
             {"presence_penalty": 1.2, "frequency_penalty": 0.7},
             {"repeat_penalty": 1.3, "repeat_last_n": -1, "presence_penalty": -0.5}]


def body(route: str, **fields) -> dict:
    """A greedy request of N tokens for `route`, with `fields`."""
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": N, **fields}
    return {"prompt": PROMPT, "max_tokens": N, **fields}


def post(server, route: str, payload: dict) -> httpx.Response:
    return httpx.post(server.base + route, json=payload, headers=server.headers, timeout=60)


def text_of(route: str, answer: dict) -> str:
    if route == "/completion":
        return answer["content"]
    choice = answer["choices"][0]
    return choice["message"]["content"] if route == "/v1/chat/completions" else choice["text"]


def answer(server, route: str, **fields) -> str:
    r = post(server, route, body(route, **fields))
    assert r.status_code == 200, r.text
    return text_of(route, r.json())


def streamed(server, route: str, **fields) -> str:
    r = post(server, route, body(route, stream=True, **fields))
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        ev = json.loads(block[6:])
        if route == "/completion":
            out.append(ev["content"])
        elif ev.get("choices"):
            delta = ev["choices"][0]
            out.append((delta.get("delta", {}).get("content") if route == "/v1/chat/completions"
                        else delta.get("text")) or "")
    return "".join(out)


@pytest.fixture(scope="module")
def spec_server(stories_path):
    ngram = SpecConfig("ngram", draft_max=16, ngram_min=1, gate=False)
    with serve(lambda: Engine.load(str(stories_path)), stories_path, spec=ngram) as s:
        yield s


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),                 # strict: a string is no number
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": 1000}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),                     # outside the vocabulary (512)
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": [[5]]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
])
def test_out_of_range_is_a_400_naming_the_field(stories_server, route, fields, param):
    r = post(stories_server, route, body(route, **fields))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if "99999" in json.dumps(fields):
        assert "token id 99999 is outside the vocabulary (0..511)" in err["message"]


@pytest.mark.parametrize("route", ROUTES)
def test_penalties_change_the_output_and_defaults_do_not(stories_server, route):
    plain = answer(stories_server, route)
    assert answer(stories_server, route, repeat_penalty=1.0, repeat_last_n=64, presence_penalty=0.0,
                  frequency_penalty=0.0, logit_bias={}) == plain          # llama.cpp's defaults: off
    assert answer(stories_server, route, repeat_penalty=1.8, repeat_last_n=0) == plain   # window 0: off
    for fields in PENALIZED:
        assert answer(stories_server, route, **fields) != plain, fields


@pytest.mark.parametrize("route", ROUTES)
def test_a_stream_carries_the_whole_answer(stories_server, route):
    for fields in [*PENALIZED, {"logit_bias": {"278": -100, "13": 4}, "frequency_penalty": 0.3}]:
        assert streamed(stories_server, route, **fields) == answer(stories_server, route, **fields), fields


@pytest.mark.parametrize("route", ROUTES)
def test_speculation_gives_the_plain_servers_text(stories_server, spec_server, route):
    for fields in [*PENALIZED, {"logit_bias": {"278": -100}, "repeat_penalty": 1.2, "repeat_last_n": 4}]:
        assert answer(spec_server, route, **fields) == answer(stories_server, route, **fields), fields
        assert streamed(spec_server, route, **fields) == answer(stories_server, route, **fields), fields
    timings = post(spec_server, route, body(route, **PENALIZED[0])).json()["timings"]
    assert timings["draft_n"] > 0                              # the spec server drafted


def test_logit_bias_bans_and_forces(stories_server):
    route = "/completion"
    first = post(stories_server, route, body(route, return_tokens=True)).json()["tokens"][0]
    banned = post(stories_server, route, body(route, return_tokens=True, logit_bias={str(first): -100})).json()
    assert first not in banned["tokens"]
    never = post(stories_server, route, body(route, return_tokens=True, logit_bias=[[first, False]])).json()
    assert never["tokens"] == banned["tokens"]                 # llama-server's pair form; false: never
    forced = post(stories_server, route, body(route, return_tokens=True, logit_bias={"100": 100})).json()
    assert forced["tokens"] == [100] * N
    piece = stories_server.state.worker.engine.tokenizer.decode([100])
    assert answer(stories_server, "/v1/completions", logit_bias={"100": 100}) == piece * N


def test_a_text_key_biases_its_tokens(stories_server):
    route = "/completion"
    plain = post(stories_server, route, body(route, return_tokens=True)).json()["tokens"]
    tok = stories_server.state.worker.engine.tokenizer
    word = tok.decode(plain[3:4]).strip()                         # a word the plain answer writes
    ids = tok.encode(word, add_special=False, parse_special=False)
    got = post(stories_server, route, body(route, return_tokens=True, logit_bias=[[word, -100]])).json()
    assert got["tokens"] != plain and not set(ids) & set(got["tokens"])


def test_openai_client_fields(stories_server):
    client = stories_server.client()
    msgs = [{"role": "user", "content": PROMPT}]
    plain = client.chat.completions.create(model="m", messages=msgs, max_tokens=N).choices[0].message.content
    pen = client.chat.completions.create(model="m", messages=msgs, max_tokens=N, presence_penalty=1.5,
                                         frequency_penalty=0.5, logit_bias={"278": -100}).choices[0].message.content
    assert pen != plain and pen == answer(stories_server, "/v1/chat/completions", presence_penalty=1.5,
                                          frequency_penalty=0.5, logit_bias={"278": -100})


def test_generation_settings_report_them(stories_server):
    r = post(stories_server, "/completion", body("/completion", repeat_penalty=1.25, repeat_last_n=-1,
                                                 logit_bias=[[7, False], [9, 2]])).json()
    s = r["generation_settings"]
    assert (s["repeat_penalty"], s["repeat_last_n"], s["presence_penalty"], s["frequency_penalty"]) == (1.25, -1, 0, 0)
    assert s["logit_bias"] == [{"token": 7, "bias": False}, {"token": 9, "bias": 2.0}]
    assert s["samplers"][0] == "penalties"


def test_server_flags_are_the_defaults(stories_path, stories_server):
    defaults = SamplingParams(repeat_penalty=1.5, presence_penalty=0.4, logit_bias=((278, -100.0),))
    with serve(lambda: Engine.load(str(stories_path)), stories_path, sampling=defaults) as s:
        for route in ROUTES:
            expected = answer(stories_server, route, repeat_penalty=1.5, presence_penalty=0.4,
                              logit_bias={"278": -100})
            assert answer(s, route) == expected, route
            assert answer(s, route, repeat_penalty=1.0, presence_penalty=0.0, logit_bias={}) == \
                answer(stories_server, route), route           # a request's fields override them

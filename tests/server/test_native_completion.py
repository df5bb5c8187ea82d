"""POST /completion, llama-server's native completion, against a real server (stories260K):
the body and answer fields its README documents, its SSE shape, and the same tokens as
the OpenAI endpoint (one engine behind both; /v1/completions is tested against llama.cpp
elsewhere)."""
from __future__ import annotations

import json

import httpx
import pytest

from serverutil import _one_torch_thread, stories_server  # noqa: F401  (fixtures)

PROMPT = "Once upon a time"
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"}
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


def post(server, body: dict, path: str = "/completion") -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60)


def events(server, body: dict) -> tuple[list[dict], str]:
    r = post(server, body | {"stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[6:]) for b in blocks], r.text


def test_whole_answer_fields_and_same_tokens_as_openai_route(stories_server):
    r = post(stories_server, {"prompt": PROMPT, "n_predict": 12, "return_tokens": True})
    assert r.status_code == 200, r.text
    a = r.json()
    assert FINAL_KEYS <= a.keys() and TIMING_KEYS <= a["timings"].keys()
    oai = post(stories_server, {"prompt": PROMPT, "max_tokens": 12, "logprobs": 0}, path="/v1/completions").json()
    assert a["content"] == oai["choices"][0]["text"]
    tok = stories_server.state.worker.engine.tokenizer
    assert len(a["tokens"]) == 12 and tok.decode(a["tokens"], continuation=True) == a["content"]
    assert (a["stop"], a["stop_type"], a["stopping_word"], a["truncated"]) == (True, "limit", "", False)
    assert a["tokens_predicted"] == 12 and a["tokens_evaluated"] == 5 and a["id_slot"] == 0
    assert a["model"] == "stories260K.gguf" and a["prompt"] == "<s> Once upon a time"
    assert a["generation_settings"]["n_predict"] == 12 and a["timings"]["predicted_n"] == 12
    # without return_tokens, tokens stays empty (README)
    assert post(stories_server, {"prompt": PROMPT, "n_predict": 4}).json()["tokens"] == []


def test_prompt_as_token_ids_and_mixed(stories_server):
    text = post(stories_server, {"prompt": PROMPT, "n_predict": 8, "return_tokens": True}).json()
    ids = httpx.post(stories_server.base + "/tokenize", json={"content": PROMPT, "add_special": True},
                     headers=stories_server.headers).json()["tokens"]
    by_ids = post(stories_server, {"prompt": ids, "n_predict": 8, "return_tokens": True}).json()
    assert by_ids["tokens"] == text["tokens"] and by_ids["tokens_evaluated"] == len(ids)
    mixed = post(stories_server, {"prompt": [ids[0], *ids[1:3], "x"], "n_predict": 2}).json()
    assert mixed["stop"] is True and mixed["tokens_evaluated"] >= 4


def test_stream_shape(stories_server):
    whole = post(stories_server, {"prompt": PROMPT, "n_predict": 10, "return_tokens": True}).json()
    evs, raw = events(stories_server, {"prompt": PROMPT, "n_predict": 10})
    assert "[DONE]" not in raw   # llama-server's native stream has no [DONE]
    partial, final = evs[:-1], evs[-1]
    assert all(e["stop"] is False and {"content", "tokens", "tokens_predicted"} <= e.keys() for e in partial)
    assert "".join(e["content"] for e in partial) == whole["content"]
    assert [t for e in partial for t in e["tokens"]] == whole["tokens"]     # tokens sent while streaming
    assert [e["tokens_predicted"] for e in partial] == sorted(e["tokens_predicted"] for e in partial)
    assert FINAL_KEYS <= final.keys() and final["stop"] is True
    assert final["content"] == "" and final["tokens"] == []                 # already streamed
    assert final["stop_type"] == "limit" and final["timings"]["predicted_n"] == 10


@pytest.mark.parametrize("stream", [False, True])
def test_stop_word(stories_server, stream):
    full = post(stories_server, {"prompt": PROMPT, "n_predict": 30}).json()["content"]
    word = "girl named"
    assert word in full
    body = {"prompt": PROMPT, "n_predict": 30, "stop": [word, "zebra"]}
    if stream:
        evs, _ = events(stories_server, body)
        content, final = "".join(e["content"] for e in evs), evs[-1]
    else:
        final = post(stories_server, body).json()
        content = final["content"]
    assert content == full[:full.index(word)]
    assert (final["stop_type"], final["stopping_word"]) == ("word", word)


def test_n_probs(stories_server):
    a = post(stories_server, {"prompt": PROMPT, "n_predict": 5, "n_probs": 3, "return_tokens": True}).json()
    probs = a["completion_probabilities"]
    assert [p["id"] for p in probs] == a["tokens"]
    oai = post(stories_server, {"prompt": PROMPT, "max_tokens": 5, "logprobs": 3}, path="/v1/completions").json()
    want = oai["choices"][0]["logprobs"]["token_logprobs"]
    for p, lp in zip(probs, want):
        assert {"id", "token", "bytes", "logprob", "top_logprobs"} <= p.keys()
        assert p["logprob"] == pytest.approx(lp, abs=1e-6)
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]   # greedy: the top one
        assert bytes(p["bytes"]).decode("utf-8", errors="ignore") == p["token"]
    evs, _ = events(stories_server, {"prompt": PROMPT, "n_predict": 3, "n_probs": 1})
    assert all(len(e["completion_probabilities"]) == len(e["tokens"]) for e in evs[:-1])


def test_n_predict_zero_evaluates_the_prompt_only(stories_server):
    a = post(stories_server, {"prompt": "Once upon a time there was", "n_predict": 0}).json()
    assert a["content"] == "" and a["tokens_predicted"] == 0 and a["stop_type"] == "limit"
    assert a["timings"]["predicted_n"] == 0 and a["timings"]["prompt_n"] >= 1
    # the rows are cached now: the same prompt again recomputes only its last row
    again = post(stories_server, {"prompt": "Once upon a time there was", "n_predict": 2}).json()
    assert again["timings"]["prompt_n"] == 1 and again["timings"]["cache_n"] == a["tokens_evaluated"] - 1
    evs, _ = events(stories_server, {"prompt": PROMPT, "n_predict": 0})
    assert len(evs) == 1 and evs[0]["stop"] is True


def test_ignore_eos_generates_past_end_of_generation(stories_server, monkeypatch):
    """llama-server's ignore_eos, on both completion routes: a token of the answer made an
    end-of-generation id ends the answer before it without ignore_eos, and is generated through
    with it (the same 12 tokens)."""
    plain = post(stories_server, {"prompt": PROMPT, "n_predict": 12, "return_tokens": True}).json()["tokens"]
    k = next(i for i in range(2, 12) if plain[i] not in plain[:i])      # its first appearance
    tok = stories_server.state.worker.engine.tokenizer
    monkeypatch.setattr(tok, "_eog", frozenset({plain[k]}))
    ended = post(stories_server, {"prompt": PROMPT, "n_predict": 12, "return_tokens": True}).json()
    assert ended["tokens"] == plain[:k] and ended["stop_type"] == "eos"
    through = post(stories_server, {"prompt": PROMPT, "n_predict": 12, "return_tokens": True,
                                    "ignore_eos": True}).json()
    assert through["tokens"] == plain and through["stop_type"] == "limit"
    oai = post(stories_server, {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}, path="/v1/completions").json()
    assert oai["usage"]["completion_tokens"] == 12 and oai["choices"][0]["finish_reason"] == "length"
    oai = post(stories_server, {"prompt": PROMPT, "max_tokens": 12}, path="/v1/completions").json()
    assert oai["usage"]["completion_tokens"] == k and oai["choices"][0]["finish_reason"] == "stop"


def test_response_fields(stories_server):
    a = post(stories_server, {"prompt": PROMPT, "n_predict": 3,
                              "response_fields": ["content", "generation_settings/n_predict", "nope/x"]}).json()
    assert set(a) == {"content", "generation_settings/n_predict"} and a["generation_settings/n_predict"] == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": PROMPT, "id_slot": 2}, "id_slot"),
    ({"prompt": [1, 99999]}, "prompt[1]"),
    ({"prompt": PROMPT, "grammar": "root ::= ((("}, "grammar"),           # GBNF that does not parse
    ({"prompt": PROMPT, "json_schema": {"type": "nonsense"}}, "json_schema"),
    ({"prompt": PROMPT, "n_predict": -2}, "n_predict"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({}, "prompt"),
])
def test_bad_bodies_are_400_naming_the_field(stories_server, body, param):
    r = post(stories_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_prompt_longer_than_the_context(stories_server):
    ctx = stories_server.state.worker.engine.ctx_size
    r = post(stories_server, {"prompt": [1] * (ctx + 5)})
    assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error"


def test_sampled_with_seed_repeats(stories_server):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 1.0, "seed": 7}
    a, b = post(stories_server, body).json(), post(stories_server, body).json()
    assert a["content"] == b["content"] and a["generation_settings"]["seed"] == 7
    assert post(stories_server, body | {"seed": -1}).json()["generation_settings"]["seed"] == 4294967295

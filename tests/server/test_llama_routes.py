"""llama-server's own routes against a real server on loopback (stories260K): /tokenize and
/detokenize against llama.cpp's answers (tests/data/reference/llama-routes-*.json, made by
bench/llama_server_routes_reference.py), /props, /slots and /apply-template in the shapes
llama-server's README documents, and the chat page at /."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import REFERENCE
from serverutil import _one_torch_thread, stories_server  # noqa: F401  (fixtures)

REF = json.loads((REFERENCE / "llama-routes-stories260K.json").read_text())


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60, **kw)


def get(server, path: str, **kw) -> httpx.Response:
    return httpx.get(server.base + path, headers=server.headers, timeout=60, **kw)


# -- /tokenize, /detokenize ---------------------------------------------------------------

@pytest.mark.parametrize("case", REF["tokenize"], ids=lambda c: f"{c['content'][:12]!r}-{c['add_special']}-"
                                                               f"{c['parse_special']}")
def test_tokenize_matches_llama_cpp(stories_server, case):
    body = {"content": case["content"], "add_special": case["add_special"], "parse_special": case["parse_special"]}
    r = post(stories_server, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": case["ids"]}
    pieces = post(stories_server, "/tokenize", body | {"with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == case["ids"]
    for p, want in zip(pieces, case["pieces"]):
        raw = bytes(want)
        try:   # the piece is its text when that is valid UTF-8, else its bytes (README: 'á' on stories260k)
            assert p["piece"] == raw.decode("utf-8")
        except UnicodeDecodeError:
            assert p["piece"] == want


def test_tokenize_defaults_are_llama_servers(stories_server):
    # add_special false, parse_special true by default
    plain = next(c for c in REF["tokenize"] if c["content"] == "Once upon a time" and not c["add_special"])
    assert post(stories_server, "/tokenize", {"content": "Once upon a time"}).json()["tokens"] == plain["ids"]
    assert post(stories_server, "/tokenize", {}).json() == {"tokens": []}


def test_tokenize_mixed_ids_and_texts(stories_server):
    once = post(stories_server, "/tokenize", {"content": "Once"}).json()["tokens"]
    upon = post(stories_server, "/tokenize", {"content": " upon"}).json()["tokens"]
    # ids pass through, each text is tokenized on its own (llama-server's tokenize_mixed), and
    # only a text in the first place gets the BOS (with add_special)
    r = post(stories_server, "/tokenize", {"content": [7, "Once", " upon"], "add_special": True})
    assert r.json()["tokens"] == [7, *once, *upon]
    r = post(stories_server, "/tokenize", {"content": ["Once", 9], "add_special": True})
    assert r.json()["tokens"] == [1, *once, 9]


@pytest.mark.parametrize("case", REF["tokenize"][::3], ids=lambda c: repr(c["content"][:12]))
def test_detokenize_joins_pieces_as_llama_cpp(stories_server, case):
    r = post(stories_server, "/detokenize", {"tokens": case["ids"]})
    assert r.status_code == 200 and r.json() == {"content": case["detokenized"]}


def test_detokenize_and_tokenize_refuse_bad_input(stories_server):
    r = post(stories_server, "/detokenize", {"tokens": [1, 512]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    assert post(stories_server, "/detokenize", {"tokens": ["a"]}).status_code == 400
    r = post(stories_server, "/tokenize", {"content": [1, -4]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert post(stories_server, "/detokenize", {}).json() == {"content": ""}
    assert httpx.post(stories_server.base + "/tokenize", json={"content": "x"}).status_code == 401   # the key


# -- /props, /slots, /apply-template ------------------------------------------------------

def test_props_in_llama_servers_shape(stories_server):
    r = get(stories_server, "/props")
    assert r.status_code == 200
    p = r.json()
    for key in ("default_generation_settings", "total_slots", "model_path", "chat_template", "modalities",
                "build_info", "is_sleeping", "bos_token", "eos_token", "model_alias"):
        assert key in p, key
    d = p["default_generation_settings"]
    assert d["n_ctx"] == stories_server.state.worker.engine.ctx_size
    for key in ("n_predict", "seed", "temperature", "top_k", "top_p", "min_p", "stop", "samplers", "n_probs"):
        assert key in d["params"], key
    assert p["total_slots"] == 1 and p["model_alias"] == "stories260K.gguf"
    assert p["model_path"].endswith("stories260K.gguf") and p["bos_token"] == "<s>"
    assert "im_start" in p["chat_template"]   # stories260K has no template: the ChatML fallback
    a = p["alphallama"]
    assert (a["device"], a["speculation"], a["mode"], a["arch"]) == ("cpu", "none", "exact", "llama")


def test_slots_idle_and_while_generating(stories_server):
    s, = get(stories_server, "/slots").json()
    assert (s["id"], s["is_processing"], s["speculative"]) == (0, False, False)
    assert s["n_ctx"] == stories_server.state.worker.engine.ctx_size
    assert get(stories_server, "/slots", params={"fail_on_no_slot": 1}).status_code == 200
    started, release = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.stream("POST", stories_server.base + "/completion", headers=stories_server.headers, timeout=60,
                          json={"prompt": "Once upon a time", "n_predict": -1, "stream": True}) as r:
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(events)
            started.set()
            release.wait(30)   # then the client leaves: the generation is cancelled
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    try:
        s, = get(stories_server, "/slots").json()
        assert s["is_processing"] is True and s["next_token"][0]["has_next_token"] is True
        assert s["next_token"][0]["n_decoded"] >= 3 and s["next_token"][0]["n_remain"] > 0   # (2,043 tokens: ~14 s)
        assert s["n_prompt_tokens"] == 5 and isinstance(s["id_task"], int)
        busy = get(stories_server, "/slots", params={"fail_on_no_slot": 1})
        assert busy.status_code == 503 and busy.json()["error"]["message"] == "no slot available"
    finally:
        release.set()
        t.join(30)
    deadline = time.monotonic() + 10
    while get(stories_server, "/slots").json()[0]["is_processing"]:
        assert time.monotonic() < deadline, "the cancelled generation kept the slot"
        time.sleep(0.02)


def test_apply_template_renders_the_chat_template(stories_server):
    r = post(stories_server, "/apply-template", {"messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert r.json() == {"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                  "<|im_start|>assistant\n"}
    assert post(stories_server, "/apply-template", {"messages": []}).status_code == 400


# -- the chat page ------------------------------------------------------------------------

def test_chat_page_is_served_without_the_key_and_fetches_nothing_elsewhere(stories_server):
    r = httpx.get(stories_server.base + "/")   # no API key: the page asks for it itself
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "/v1/chat/completions" in page and "/props" in page
    assert "http://" not in page and "https://" not in page and "//cdn" not in page   # no CDN, nothing remote
    assert "default-src 'self'" in r.headers["content-security-policy"]

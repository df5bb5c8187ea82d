"""The OpenAI endpoints through the real `openai` client against a real server on loopback
(stories260K: greedy output is fixed, so texts can be compared)."""
from __future__ import annotations

import httpx
import pytest

from serverutil import _one_torch_thread, stories_server  # noqa: F401  (fixtures)

PROMPT = "Once upon a time"
TIMING_KEYS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
               "draft_n", "draft_n_accepted"}


def complete(client, **kw):
    return client.completions.create(model="stories260K.gguf", prompt=PROMPT, **kw)


def streamed_text(chunks) -> tuple[str, list]:
    chunks = list(chunks)
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_completion_usage_and_timings(stories_server):
    r = complete(stories_server.client(), max_tokens=12)
    assert r.object == "text_completion" and r.model == "stories260K.gguf"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(", there was")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    t = r.model_extra["timings"]
    assert TIMING_KEYS <= t.keys()
    assert t["predicted_n"] == 12 and t["predicted_per_second"] > 0
    # The same prompt again: its rows come from the KV cache, only the last is recomputed.
    again = complete(stories_server.client(), max_tokens=12)
    assert again.choices[0].text == r.choices[0].text
    assert again.model_extra["timings"]["prompt_n"] == 1 and again.usage.prompt_tokens == 5


def test_completion_streaming_matches_whole(stories_server):
    client = stories_server.client()
    whole = complete(client, max_tokens=20).choices[0].text
    text, chunks = streamed_text(complete(client, max_tokens=20, stream=True))
    assert text == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 20


def test_stream_include_usage(stories_server):
    chunks = list(complete(stories_server.client(), max_tokens=7, stream=True,
                           stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 7 and last.usage.prompt_tokens == 5
    assert last.model_extra["timings"]["predicted_n"] == 7
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_spanning_tokens_are_never_emitted(stories_server, stream):
    client = stories_server.client()
    full = complete(client, max_tokens=30).choices[0].text   # ", there was a little girl named Lily. ..."
    stop = "girl named"
    assert stop in full
    if stream:
        text, chunks = streamed_text(complete(client, max_tokens=30, stop=[stop, "zebra"], stream=True))
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = complete(client, max_tokens=30, stop=[stop, "zebra"])
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[:full.index(stop)]
    assert finish == "stop"


def test_stop_that_never_appears_changes_nothing(stories_server):
    client = stories_server.client()
    full = complete(client, max_tokens=15).choices[0].text
    r = complete(client, max_tokens=15, stop="zebra")
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


def test_chat_completion(stories_server):
    client = stories_server.client()
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me one."}]
    r = client.chat.completions.create(model="stories260K.gguf", messages=messages, max_tokens=10)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens > 10
    assert r.model_extra["timings"]["predicted_n"] == 10

    chunks = list(client.chat.completions.create(model="stories260K.gguf", messages=messages, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].model_extra["timings"]["prompt_n"] >= 1


def test_chat_logprobs(stories_server):
    r = stories_server.client().chat.completions.create(
        model="stories260K.gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)   # greedy: the top token
        assert bytes(e.bytes).decode() == e.token


def test_completion_logprobs_streamed(stories_server):
    chunks = list(complete(stories_server.client(), max_tokens=5, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 5 and "".join(tokens) == "".join(c.choices[0].text for c in chunks)


def test_token_id_prompt(stories_server):
    r = stories_server.client().completions.create(model="stories260K", prompt=[1, 403, 407, 261, 378],
                                                   max_tokens=8)
    assert r.choices[0].text == complete(stories_server.client(), max_tokens=8).choices[0].text


def test_models_health_metrics_openapi(stories_server):
    client = stories_server.client()
    assert [m.id for m in client.models.list()] == ["stories260K.gguf"]
    base = stories_server.base
    assert httpx.get(base + "/health").json() == {"status": "ok"}          # no key needed
    assert httpx.get(base + "/openapi.json").json()["paths"].keys() >= {"/v1/chat/completions",
                                                                        "/v1/completions", "/v1/models"}
    complete(client, max_tokens=3)
    text = httpx.get(base + "/metrics", headers=stories_server.headers).text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert float(samples['alphallama_requests_total{endpoint="completions",outcome="ok"}']) >= 1
    assert float(samples["alphallama_tokens_predicted_total"]) >= 3
    assert float(samples["alphallama_decode_tokens_per_second"]) > 0
    assert samples["alphallama_queue_depth"] == "0" and samples["alphallama_model_loaded"] == "1"
    assert not [k for k in samples if k.startswith("alphallama_expert_")]   # no expert store: no store lines


def test_curl_style_request_without_content_type(stories_server):
    headers = {**stories_server.headers, "Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(stories_server.url + "/completions", headers=headers, content=b'{"prompt": "Once upon a time", "max_tokens": 3}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_browser_preflight_needs_no_key(stories_server):
    r = httpx.options(stories_server.url + "/chat/completions",
                      headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://localhost:3000")

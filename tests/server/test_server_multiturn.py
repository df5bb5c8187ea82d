"""A follow-up chat turn re-uses the KV cache of the conversation so far: its
`timings.prompt_n` counts only the new tokens (a random-weight qwen3 with the real Qwen2
tokenizer and ChatML template, so the turns tokenize as a real chat model's do)."""
from __future__ import annotations

import pytest

from alphallama.engine import Engine

from serverutil import _one_torch_thread, qwen_path, serve, stories_server  # noqa: F401  (fixtures)

MODEL = "tiny-qwen3.gguf"


@pytest.fixture(scope="module")
def qwen_server(qwen_path):
    with serve(lambda: Engine.load(str(qwen_path)), qwen_path) as s:
        yield s


def chat(client, messages, stream: bool, n: int = 6):
    if not stream:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n)
        return r.choices[0].message.content, r.usage, r.model_extra["timings"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage, chunks[-1].model_extra["timings"]


@pytest.mark.shared
@pytest.mark.parametrize("stream", [False, True])
def test_second_turn_prefills_only_the_new_tokens(qwen_server, stream):
    client = qwen_server.client()
    history = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": f"Name three colours. ({stream})"}]
    reply, u1, t1 = chat(client, history, stream)
    assert t1["prompt_n"] >= 1 and u1.prompt_tokens > 10

    engine = qwen_server.state.worker.engine
    cached = list(engine.cached)   # read while the engine is idle: the first prompt and the reply's tokens

    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And three more?"}]
    _, u2, t2 = chat(client, history, stream)
    new_tokens = u2.prompt_tokens - u1.prompt_tokens   # the reply, its end marker, the new question
    assert t2["prompt_n"] <= new_tokens
    assert t2["cache_n"] >= u1.prompt_tokens            # the whole first prompt came from the cache
    assert t2["prompt_n"] + t2["cache_n"] == u2.prompt_tokens
    # Exactly the tokens the cache did not hold were computed. (The reply's tokens count as
    # held only as far as its text re-tokenizes to the same ids: this random-weight model's
    # replies often do not, a real model's usually do.)
    ids = engine.encode_chat(history)
    common = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
    assert t2["prompt_n"] == len(ids) - common


@pytest.mark.shared
def test_an_unrelated_conversation_is_prefilled_again(qwen_server):
    client = qwen_server.client()
    chat(client, [{"role": "user", "content": "first conversation about boats"}], False, n=2)
    _, u, t = chat(client, [{"role": "system", "content": "Different system prompt entirely."},
                            {"role": "user", "content": "second"}], False, n=2)
    assert t["prompt_n"] > u.prompt_tokens // 2


def test_continuing_a_completion_prefills_only_the_continuation(stories_server):
    # The history's generated part comes from the cache as far as its text re-tokenizes to
    # the ids it was generated as (on this host stories260K's greedy text does all the way;
    # a host whose arithmetic picks another near-tie token may stop earlier).
    client = stories_server.client()
    first = client.completions.create(model="stories260K.gguf", prompt="Once upon a time", max_tokens=24)
    engine = stories_server.state.worker.engine
    cached = list(engine.cached)   # read while the engine is idle: the prompt and the reply's tokens
    prompt = "Once upon a time" + first.choices[0].text + " Then"
    second = client.completions.create(model="stories260K.gguf", prompt=prompt, max_tokens=2)
    t = second.model_extra["timings"]
    assert second.usage.prompt_tokens >= 5 + 24
    ids = engine.encode_prompt(prompt)
    common = next((i for i, (a, b) in enumerate(zip(cached, ids)) if a != b), min(len(cached), len(ids)))
    assert common >= first.usage.prompt_tokens                 # the whole first prompt is re-used
    assert t["prompt_n"] == len(ids) - min(common, len(ids) - 1), t   # exactly the rows not held
    assert t["prompt_n"] + t["cache_n"] == second.usage.prompt_tokens

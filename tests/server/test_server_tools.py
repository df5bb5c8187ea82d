"""Tool calls and structured output through the real `openai` client against `alphallama
serve` (a subprocess, the embedded model, CPU), and with Qwen2.5-Coder-0.5B where it is
present. The JSON a response holds is checked by jsonschema, not by the grammar library."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import jsonschema
import pytest
import torch
from conftest import QWEN, ROOT, require
from openai import BadRequestError, OpenAI
from serverutil import free_port, wait_healthy
from test_server_cli import serve_command

sys.path.insert(0, str(ROOT / "bench"))
# the tools and schemas bench/gpu_server_tools.py sends on the GPU: one definition for both
from gpu_server_tools import ADD, ASK, PERSON, TOOLS, WEATHER  # noqa: E402

NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def _serve(args: list[str], timeout: float):
    port = free_port()
    proc = subprocess.Popen(serve_command() + ["--port", str(port), "--api-key", "k", "-t", "1", *args],
                            stderr=subprocess.PIPE, text=True)
    wait_healthy(proc, port, timeout, proc.stderr.read)
    return proc, OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=300)


def _stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def embedded():
    proc, client = _serve(["--device", "cpu", "--spec-type", "ngram", "--no-gate"], 120)   # no -m: the embedded model
    yield client
    _stop(proc)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(chunks) -> tuple[str, list[tuple[str, dict]], str]:
    """Content, calls and finish_reason put together from the chunks as a client does."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            assert tc.index == len(calls) - 1 or tc.id is None     # ids come with a call's first delta
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_tool_call(embedded, choice):
    kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=CHOICES[choice], parallel_tool_calls=False,
              max_tokens=60, temperature=0)
    r = embedded.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", msg
    [(name, args)] = _calls(msg)
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    schema = {"get_weather": WEATHER, "add": ADD}[name]
    jsonschema.validate(args, schema)
    if choice == "named":
        assert name == "get_weather"
    # streaming: the same call in OpenAI's chunk shape
    content, calls, finish = _streamed(embedded.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == ((msg.content or ""), [(name, args)], "tool_calls")


def test_history_with_tool_calls_and_results(embedded):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = embedded.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=12)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the history reached the template: a prompt with the call and its result is longer than without
    bare = embedded.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens + 10


def test_tool_choice_none_and_auto_answer(embedded):
    for choice in ("none", "auto"):
        r = embedded.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=20)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert c.message.content or c.message.tool_calls
    none = embedded.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    auto = embedded.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1)
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens   # "none": the tools are not rendered


def test_tool_call_response_matches_the_openapi_schema(embedded):
    import httpx
    from test_server_openapi import check_against_schema
    base = str(embedded.base_url).removesuffix("/v1/").removesuffix("/v1")
    doc = httpx.get(base + "/openapi.json").json()
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k"}, timeout=300,
                   json={"messages": ASK, "tools": TOOLS, "tool_choice": CHOICES["named"], "max_tokens": 60})
    assert r.json()["choices"][0]["message"]["content"] is None
    check_against_schema(doc, "post", "/v1/chat/completions", r)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_validates(embedded, stream):
    kw = dict(model="m", messages=[{"role": "user", "content": "Describe a programmer as JSON."}], max_tokens=120,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in embedded.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    else:
        r = embedded.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "stop"
        text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_response(embedded):
    r = embedded.chat.completions.create(model="m", messages=[{"role": "user", "content": "Give me JSON."}],
                                         max_tokens=150, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_llama_server_grammar_fields(embedded):
    import httpx
    base = str(embedded.base_url).removesuffix("/v1/").removesuffix("/v1")
    gbnf = 'root ::= "answer: " ("yes" | "no") "."'
    r = httpx.post(base + "/completion", headers={"Authorization": "Bearer k"}, timeout=300,
                   json={"prompt": "def f():", "n_predict": 20, "grammar": gbnf}).json()
    assert r["content"] in ("answer: yes.", "answer: no."), r
    r = httpx.post(base + "/completion", headers={"Authorization": "Bearer k"}, timeout=300,
                   json={"prompt": "x = ", "n_predict": 40, "json_schema": NUMBERS}).json()
    jsonschema.validate(json.loads(r["content"]), NUMBERS)
    chat = embedded.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"grammar": gbnf})
    assert chat.choices[0].message.content in ("answer: yes.", "answer: no.")
    chat = embedded.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"json_schema": NUMBERS})
    jsonschema.validate(json.loads(chat.choices[0].message.content), NUMBERS)


def test_text_completions_take_the_grammar_fields(embedded):
    """/v1/completions honours response_format (as vLLM's does) and llama-server's json_schema /
    grammar (as its /v1/completions does): they were dropped, and the text came back free."""
    gbnf = 'root ::= "answer: " ("yes" | "no") "."'
    r = embedded.completions.create(model="m", prompt="x = ", max_tokens=40, extra_body={"json_schema": NUMBERS})
    jsonschema.validate(json.loads(r.choices[0].text), NUMBERS)
    r = embedded.completions.create(model="m", prompt="def f():", max_tokens=20, extra_body={"grammar": gbnf})
    assert r.choices[0].text in ("answer: yes.", "answer: no.")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS}}
    text = "".join(ch.choices[0].text for ch in embedded.completions.create(
        model="m", prompt="x = ", max_tokens=40, stream=True, extra_body={"response_format": fmt}) if ch.choices)
    jsonschema.validate(json.loads(text), NUMBERS)
    with pytest.raises(BadRequestError) as e:
        embedded.completions.create(model="m", prompt="x", max_tokens=5, extra_body={"json_schema": {"type": "nonsense"}})
    assert e.value.body["param"] == "json_schema"


@pytest.mark.parametrize("kw, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, None),
    ({"extra_body": {"grammar": "root ::= ((("}}, "grammar"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_requests_are_400(embedded, kw, param):
    with pytest.raises(BadRequestError) as e:
        embedded.chat.completions.create(model="m", messages=ASK, max_tokens=5, **kw)
    if param is not None:
        assert e.value.body["param"].startswith(param), e.value.body   # tools[0].function.name: the field


@pytest.mark.shared
@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU half needs CUDA"))])
def test_qwen_coder_tool_calls(device):
    require(QWEN)
    proc, client = _serve(["-m", str(QWEN), "--device", device, "-c", "2048"], 600)
    try:
        kw = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0)
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        [(name, args)] = _calls(r.choices[0].message)
        assert name == "get_weather" and args["city"] == "Paris"
        assert _streamed(client.chat.completions.create(**kw, stream=True))[1:] == ([(name, args)], "tool_calls")
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a programmer."}],
                                           max_tokens=120, response_format={
                                               "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    finally:
        _stop(proc)


def test_auto_with_a_strict_tool(embedded):
    """tool_choice auto with a strict tool: the answer is text or calls, and a strict
    tool's arguments validate (a lazy grammar: tool_formats.lazy_grammar)."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    for ask in (ASK, [{"role": "user", "content": "Use the add tool on 2 and 3."}]):
        r = embedded.chat.completions.create(model="m", messages=ask, tools=strict, max_tokens=60)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls") and (c.message.content or c.message.tool_calls)
        for name, args in _calls(c.message):
            jsonschema.validate(args, WEATHER if name == "get_weather" else ADD)

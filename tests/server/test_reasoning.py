"""A thinking model's <think> text split into reasoning_content (server/reasoning.py): on
hand-written answers streamed in every chunking, with tool calls after it, and through
`alphallama serve` (the embedded model, CPU) with a template that opens <think> itself."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import TEMPLATES

from alphallama.server.chat_output import ToolChatFormat
from alphallama.server.reasoning import ReasoningStream, ThinkTags, reasoning_tags
from alphallama.server.responses import ChatFormat
from alphallama.server.tool_formats import HermesFormat
from alphallama.server.tool_stream import ToolStream

TAGS = ThinkTags()


def _all_chunkings(text: str):
    """The whole text, one character at a time, and cut at every point into two."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("text, inside, reasoning, content", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, "\nplan it\n", "The answer."),
    ("  <think>a < b</think>ok", False, "a < b", "ok"),
    ("plan it</think>\nThe answer.", True, "plan it", "The answer."),
    ("Hello <think>not at the start</think>", False, "", "Hello <think>not at the start</think>"),
    ("<thinking> is a word", False, "", "<thinking> is a word"),
    ("<think>cut off while thin", False, "cut off while thin", ""),
    ("</thin", True, "</thin", ""),
    ("", False, "", ""),
])
def test_split_in_every_chunking(text, inside, reasoning, content):
    for pieces in _all_chunkings(text) if text else [[]]:
        s = ReasoningStream(TAGS, inside)
        got = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content), pieces
    assert s.reasoning == reasoning


def test_tags_from_the_template_and_the_prompt():
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert reasoning_tags(qwen3, "auto") == TAGS and reasoning_tags(qwen3, "deepseek") == TAGS
    assert reasoning_tags(qwen3, "none") is None
    assert reasoning_tags((TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), "auto") is None
    assert TAGS.open_at_end("<|im_start|>assistant\n<think>\n")
    assert not TAGS.open_at_end("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not TAGS.open_at_end("<|im_start|>assistant\n")


def test_chat_chunks_and_response(tmp_path):
    from conftest import STORIES

    from alphallama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(STORIES)
    text = "<think>weigh it</think>\n\nDone."
    f = ChatFormat("m", tok, False, ReasoningStream(TAGS, False))
    chunks = [f.chunk(p, [], None) for p in ("<thi", "nk>weigh", " it</th", "ink>\n\nDo", "ne.")]
    chunks.append(f.chunk(None, [], "stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "weigh it"
    assert "".join(d.get("content", "") for d in deltas) == "Done."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    message = ChatFormat("m", tok, False, ReasoningStream(TAGS, False)).response(text, None, "stop", {}, {})
    message = message["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Done.", "reasoning_content": "weigh it"}
    plain = ChatFormat("m", tok, False).response(text, None, "stop", {}, {})["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": text}      # no splitter: the text as it was


def test_reasoning_then_a_tool_call():
    from conftest import STORIES

    from alphallama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(STORIES)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text = "<think>I should call add. <tool_call> is how.</think>\n" + call
    f = ToolChatFormat("m", tok, False, ToolStream(HermesFormat(), frozenset({"add"})), ReasoningStream(TAGS, False))
    message = f.response(text, None, "stop", {}, {})["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    m = message["message"]
    assert m["reasoning_content"] == "I should call add. <tool_call> is how." and m["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == \
        [("add", {"a": 1, "b": 2})]


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                     "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from test_server_tools import _serve, _stop
    path = tmp_path_factory.mktemp("tmpl") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    proc, client = _serve(["--device", "cpu", "--spec-type", "none", "--chat-template-file", str(path)], 120)
    yield str(client.base_url).removesuffix("/").removesuffix("/v1")
    _stop(proc)


def _chat(base: str, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
            "max_tokens": 12, **body}
    return httpx.post(base + "/v1/chat/completions", headers={"Authorization": "Bearer k"}, json=body, timeout=300)


def test_served_answer_starts_in_reasoning(thinking_server):
    """The template opens <think> in the generation prompt: the answer is reasoning until
    </think> (the embedded model never writes one in 12 tokens); reasoning_format none,
    or enable_thinking false (the template then closes it), leaves it all in content."""
    r = _chat(thinking_server).json()["choices"][0]["message"]
    assert r["reasoning_content"] and r["content"] == ""
    none = _chat(thinking_server, reasoning_format="none").json()["choices"][0]["message"]
    assert none["reasoning_content"] is None and none["content"] == r["reasoning_content"]
    off = _chat(thinking_server, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["choices"][0]["message"]["reasoning_content"] is None and off["choices"][0]["message"]["content"]
    assert off["usage"]["prompt_tokens"] > _chat(thinking_server).json()["usage"]["prompt_tokens"]
    with httpx.stream("POST", thinking_server + "/v1/chat/completions", headers={"Authorization": "Bearer k"},
                      json={"messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
                            "max_tokens": 12, "stream": True}, timeout=300) as s:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == r["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)


def test_bad_template_kwargs_are_400(thinking_server):
    r = _chat(thinking_server, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and "chat_template_kwargs" in r.text
    assert _chat(thinking_server, reasoning_format="sideways").status_code == 400

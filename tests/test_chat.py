"""Chat templates: the real Qwen2.5, Qwen3 and Llama 3.1 templates rendered to strings
derived by hand from reading them, the HF helpers, the sandbox, and llama.cpp's prompt."""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from alphallama.chat import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, chat_prompt_ids
from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.tokenizer import Tokenizer
from conftest import REFERENCE, TEMPLATES, VOCAB

QWEN = Path(os.environ.get("ALPHA_MODELS", Path.home() / ".cache" / "alphallama" / "models")) \
    / "qwen2.5-coder-0.5b-instruct.gguf"

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOLS_JSON = ('{"type": "function", "function": {"name": "get_weather", "description": "Météo d\'une ville", '
              '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
              '"required": ["city"]}}}')
TOOL_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                 + TOOLS_JSON + "\n</tools>\n\nFor each function call, return a json object with function "
                 "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "18°C"},
    {"role": "tool", "content": "sunny"},
]


def template(name: str, **kw) -> ChatTemplate:
    path = TEMPLATES / name
    if not path.exists():
        pytest.skip(f"{path} is not present")
    return ChatTemplate(path.read_text(), **kw)


@pytest.fixture(scope="module")
def qwen25():
    return template("Qwen-Qwen2.5-7B-Instruct.jinja")


@pytest.fixture(scope="module")
def qwen3():
    return template("Qwen-Qwen3-0.6B.jinja")


@pytest.fixture(scope="module")
def llama31():
    return template("meta-llama-Llama-3.1-8B-Instruct.jinja", bos_token="<|begin_of_text|>")


def im(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


# -- Qwen2.5 ------------------------------------------------------------------

def test_qwen25_default_system_prompt(qwen25):
    msgs = [{"role": "user", "content": "Hi"}]
    assert qwen25.render(msgs) == im("system", QWEN_DEFAULT_SYSTEM) + im("user", "Hi") + "<|im_start|>assistant\n"
    assert qwen25.render(msgs, add_generation_prompt=False) == im("system", QWEN_DEFAULT_SYSTEM) + im("user", "Hi")


def test_qwen25_multi_turn_with_system(qwen25):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    assert qwen25.render(msgs) == (im("system", "Be brief.") + im("user", "Hi") + im("assistant", "Hello!")
                                   + im("user", "2+2?") + "<|im_start|>assistant\n")


def test_qwen25_tools(qwen25):
    expected = (
        "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "\n\n" + TOOL_PREAMBLE
        + im("user", "Weather in Paris?")
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          "</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nsunny\n"
          "</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n")
    assert qwen25.render(TOOL_ROUND, tools=TOOLS) == expected


def test_qwen_coder_reference_prompt(qwen25):
    # llama.cpp's server rendered these prompts from one user message each; the coder
    # model's template is the same text as Qwen2.5-7B-Instruct's.
    cases = json.loads((REFERENCE / "qwen2.5-coder-0.5b-instruct.json").read_text())["cases"]
    chats = [c for c in cases if c["kind"] == "chat"]
    assert chats
    for case in chats:
        assert qwen25.render([{"role": "user", "content": case["input"]}]) == case["prompt"]


def test_qwen_coder_own_template_and_prompt_ids():
    if not QWEN.exists():
        pytest.skip(f"{QWEN} is not present (../shared/tools/fetch-models.sh)")
    md = GGUFFile(QWEN).metadata
    tmpl, tok = ChatTemplate.from_gguf_metadata(md), Tokenizer.from_metadata(md)
    assert (tmpl.bos_token, tmpl.eos_token) == ("<|endoftext|>", "<|im_end|>")
    cases = json.loads((REFERENCE / "qwen2.5-coder-0.5b-instruct.json").read_text())["cases"]
    for case in (c for c in cases if c["kind"] == "chat"):
        msgs = [{"role": "user", "content": case["input"]}]
        assert tmpl.render(msgs) == case["prompt"]
        assert chat_prompt_ids(tmpl, tok, msgs) == case["prompt_ids"]


# -- Qwen3 ----------------------------------------------------------------------

def test_qwen3_no_default_system_and_thinking(qwen3):
    msgs = [{"role": "user", "content": "Hi"}]
    assert qwen3.render(msgs) == im("user", "Hi") + "<|im_start|>assistant\n"
    assert qwen3.render(msgs, enable_thinking=False) == (
        im("user", "Hi") + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the last answer keeps its reasoning, split out of the content ...
    turn = msgs + [{"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"}]
    assert qwen3.render(turn, add_generation_prompt=False) == (
        im("user", "Hi") + im("assistant", "<think>\nplan\n</think>\n\nHello!"))
    # ... answers before the last user query lose it
    more = turn + [{"role": "user", "content": "Bye"}]
    assert qwen3.render(more) == (im("user", "Hi") + im("assistant", "Hello!") + im("user", "Bye")
                                  + "<|im_start|>assistant\n")


def test_qwen3_tools(qwen3):
    system = [{"role": "system", "content": "Be brief."}]
    assert qwen3.render(system + TOOL_ROUND[:1], tools=TOOLS) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOL_PREAMBLE + im("user", "Weather in Paris?")
        + "<|im_start|>assistant\n")
    assert qwen3.render(TOOL_ROUND, tools=TOOLS) == (
        "<|im_start|>system\n" + TOOL_PREAMBLE + im("user", "Weather in Paris?")
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          "</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nsunny\n"
          "</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n")


def test_qwen3_fails_cleanly_without_messages(qwen3):
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        qwen3.render([])


# -- Llama 3.1 ------------------------------------------------------------------

def header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


LLAMA_SYSTEM = header("system") + "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def test_llama31_multi_turn(llama31):
    msgs = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert llama31.render(msgs) == (
        "<|begin_of_text|>" + LLAMA_SYSTEM + "Be brief.<|eot_id|>" + header("user") + "Hi<|eot_id|>"
        + header("assistant") + "Hello!<|eot_id|>" + header("assistant"))
    assert llama31.render(msgs[1:2], add_generation_prompt=False) == (
        "<|begin_of_text|>" + LLAMA_SYSTEM + "<|eot_id|>" + header("user") + "Hi<|eot_id|>")
    assert "Today Date: 05 Mar 2025\n" in llama31.render(msgs, date_string="05 Mar 2025")


def test_llama31_tools(llama31):
    tools_json = json.dumps(TOOLS[0], indent=4, ensure_ascii=False)
    assert llama31.render(TOOL_ROUND[:1], tools=TOOLS) == (
        "<|begin_of_text|>" + header("system") + "Environment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        + header("user") + "Given the following functions, please respond with a JSON for a function call "
        "with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n" + tools_json + "\n\nWeather in Paris?<|eot_id|>" + header("assistant"))
    call = llama31.render(TOOL_ROUND[:3], add_generation_prompt=False)
    # a tool call is JSON with "parameters"; a string tool result is iterable, so tojson quotes it
    assert call.endswith(header("assistant") + '{"name": "get_weather", "parameters": {"city": "Paris"}}'
                         "<|eot_id|>" + header("ipython") + '"18°C"<|eot_id|>')


def test_llama31_raise_exception(llama31):
    with pytest.raises(ChatTemplateError) as e:
        llama31.render([{"role": "system", "content": "x"}], tools=TOOLS)
    assert str(e.value) == "Cannot put tools in the first user message when there's no first user message!"
    two_calls = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL, CALL]}]
    with pytest.raises(ChatTemplateError, match="only supports single tool-calls at once"):
        llama31.render(two_calls)


@pytest.mark.shared
def test_chat_prompt_ids_does_not_double_bos(llama31):
    path = VOCAB / "ggml-vocab-llama-bpe.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not present")
    tok = Tokenizer.from_gguf(path)
    ids = chat_prompt_ids(llama31, tok, [{"role": "user", "content": "Hi"}])
    assert ids[:2] == [tok.bos_id, tok.id_of("<|start_header_id|>")]
    assert ids[-2:] == [tok.id_of("<|end_header_id|>"), tok.id_of("ĊĊ")]


# -- the environment: helpers, whitespace control, sandbox ---------------------------

def test_strftime_now_uses_the_clock():
    src = ('{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}'
           "Today Date: {{ date_string }}")
    t = ChatTemplate(src, clock=lambda: datetime(2025, 3, 5, 12, 0))
    assert t.render([]) == "Today Date: 05 Mar 2025"
    assert t.render([], date_string="1 Jan 2000") == "Today Date: 1 Jan 2000"


def test_tojson_has_hf_semantics():
    t = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}")
    x = {"a": "é<b>&'", "n": [1, 2]}
    assert t.render([], x=x) == (json.dumps(x, ensure_ascii=False) + "|" + json.dumps(x, ensure_ascii=False, indent=2)
                                 + "|" + '{"a":"é<b>&\'","n":[1,2]}')


def test_trim_and_lstrip_blocks_loop_controls_and_generation_tag():
    src = ("{% for m in messages %}\n"
           "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
           "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
           "[{{ m.content }}]\n"
           "{% endfor %}\n"
           "{% generation %}{{ bos_token }}{{ eos_token }}{% endgeneration %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "user", "content": "v"}]
    assert ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(msgs) == "[u]\n<s></s>"


@pytest.mark.parametrize("src", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append(1) }}",
    "{% set m = messages[0] %}{{ m.update({'role': 'x'}) }}",
])
def test_sandbox_refuses_unsafe_access(src):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate(src).render(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


def test_syntax_error():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m }")


# -- templates from GGUF metadata ---------------------------------------------------

@pytest.mark.shared
def test_from_gguf_metadata():
    path = VOCAB / "ggml-vocab-qwen2.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not present")
    md = GGUFFile(path).metadata
    t = ChatTemplate.from_gguf_metadata(md)
    assert t.source == md["tokenizer.chat_template"] and t.bos_token == t.eos_token == "<|endoftext|>"
    assert t.render([{"role": "user", "content": "Hi"}]) == (
        im("system", "You are a helpful assistant") + im("user", "Hi") + "<|im_start|>assistant\n")


def test_missing_template_falls_back_to_chatml(caplog):
    md = {"tokenizer.ggml.tokens": ["<s>", "</s>"], "tokenizer.ggml.bos_token_id": 0,
          "tokenizer.ggml.eos_token_id": 1}
    t = ChatTemplate.from_gguf_metadata(md)
    assert t.source == CHATML_TEMPLATE and "ChatML" in caplog.text
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert t.render(msgs) == im("system", "S") + im("user", "U") + "<|im_start|>assistant\n"
    assert t.render(msgs, add_generation_prompt=False) == im("system", "S") + im("user", "U")
    assert ChatTemplate.from_gguf_metadata(md, fallback=None) is None
    with pytest.raises(GGUFError, match="must be a string"):
        ChatTemplate.from_gguf_metadata({"tokenizer.chat_template": 3})

"""Tool-call formats on hand-written model outputs of each family, broken ones included: the
format is found from the template's text, calls are decoded (or the text stays content),
streaming in any chunking gives what the whole text gives, and the forcing grammars accept
the format's own calls and nothing else."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TEMPLATES

from alphallama.grammar import GrammarVocab, TokenConstraint, lark_grammar
from alphallama.server.chat_output import closed_objects
from alphallama.server.tool_formats import (
    HermesFormat,
    Llama3Format,
    MistralFormat,
    ToolSpec,
    format_for_template,
)
from alphallama.server.tool_stream import ToolStream
from alphallama.tokenizer import Tokenizer

NAMES = frozenset({"get_weather", "add"})
EMBEDDED = Path(__file__).resolve().parents[2] / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"
# Mistral's templates are not in tests/data: the lines of one that carry its markers.
MISTRAL_TEMPLATE = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
                    "{%- for m in messages %}{%- if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls|tojson }}"
                    "{%- endif %}{%- endfor %}")


def split(fmt, text: str, chunks: int | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) from a ToolStream fed `text` in pieces of `chunks` chars."""
    s = ToolStream(fmt, NAMES)
    step = chunks or max(len(text), 1)
    content = "".join(s.feed(text[i:i + step])[0] for i in range(0, len(text), step)) + s.finish()[0]
    return content, [(c.name, json.loads(c.arguments)) for c in s.calls]


@pytest.mark.parametrize("name, fmt", [("Qwen-Qwen2.5-7B-Instruct.jinja", HermesFormat),
                                       ("Qwen-Qwen3-0.6B.jinja", HermesFormat),
                                       ("meta-llama-Llama-3.1-8B-Instruct.jinja", Llama3Format)])
def test_format_found_from_the_template(name, fmt):
    assert isinstance(format_for_template((TEMPLATES / name).read_text()), fmt)


def test_mistral_and_unknown_templates():
    assert isinstance(format_for_template(MISTRAL_TEMPLATE), MistralFormat)
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert format_for_template(chatml) is None


HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', "",   # string arguments, unclosed at EOS
     [("add", {"a": 1, "b": 2})]),
    ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    # Qwen2.5-Coder's untagged calls (seen through the server under tool_choice auto)
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ('\n```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', "", [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 3, "b": 4}}', "",
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("```python\ndef f():\n    return {}\n```", "```python\ndef f():\n    return {}\n```", []),
    ('The call would be {"name": "add", "arguments": {}}', 'The call would be {"name": "add", "arguments": {}}', []),
    # untagged calls after text: the answer's end from a line that opens {"name"
    ('Sure:\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "Sure:", [("add", {"a": 1, "b": 2})]),
    ('I will call it.\n\n```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```\n', "I will call it.",
     [("get_weather", {"city": "Oslo"})]),
    ('Two:\n{"name": "add", "arguments": {"a": 1}}\n{"name": "add", "arguments": {"a": 2}}', "Two:",
     [("add", {"a": 1}), ("add", {"a": 2})]),
    ("int main()\n{\n  return 0;\n}\n", "int main()\n{\n  return 0;\n}", []),
    ('Config:\n```json\n{"names": ["a"]}\n```', 'Config:\n```json\n{"names": ["a"]}\n```', []),
]
HERMES_BROKEN = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',      # cut JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',            # not a tool offered
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',                       # no name
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',                   # arguments not an object
    '<tool_call>\n{"name": "add", "arguments": {}} {"name": "add"}\n</tool_call>',       # two objects in one tag
    '{"answer": 4}',                                                                     # bare JSON, not a call
    '{"name": "add", "arguments": {"a": 1, "b": 2}} and then some words',               # a bare call and text
    '```json\n{"name": "add", "arguments": {"a": 1}}',                                 # an unclosed fence
    '{"name": "launch_rockets", "arguments": {}}',                                      # bare, not a tool offered
    'Sure:\n{"name": "add", "arguments": {"a": 1}}\nThat adds them.',                   # a call amid prose
    'An example:\n{"name": "print", "arguments": {}}',                                  # not a tool offered
    'Sure:\n{"name": "add", "arguments": {"a": 1}',                                     # cut JSON after text
]


@pytest.mark.parametrize("text, content, calls", HERMES)
@pytest.mark.parametrize("chunks", [None, 1, 3, 7])
def test_hermes(text, content, calls, chunks):
    got_content, got_calls = split(HermesFormat(), text, chunks)
    assert (got_content.strip(), got_calls) == (content, calls)


@pytest.mark.parametrize("text", HERMES_BROKEN)
@pytest.mark.parametrize("chunks", [None, 2])
def test_hermes_malformed_calls_stay_text(text, chunks):
    assert split(HermesFormat(), text, chunks) == (text, [])


def test_hermes_a_broken_call_beside_a_good_one():
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'
    assert split(HermesFormat(), good + "\n" + bad, 4) == ("\n" + bad, [("add", {"a": 1, "b": 2})])


LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ('  {"name": "add", "arguments": {"a": 3, "b": 4}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("add", {"a": 3, "b": 4}), ("get_weather", {"city": "Oslo"})]),
    ("The weather is sunny. {not a call}", "The weather is sunny. {not a call}", []),
    ("Sure.<|python_tag|>{\"name\": \"add\", \"parameters\": {\"a\": 0, \"b\": 0}}", "Sure.", [("add", {"a": 0, "b": 0})]),
]
LLAMA_BROKEN = ['{"name": "get_weather", "parameters": {"city": "Paris"}',              # unclosed
                '{"name": "get_weather", "parameters": {"city": "Paris"}} and more words',
                '{"answer": 42}',                                                        # JSON, not a call
                '<|python_tag|>brave_search.call(query="x")']                           # a built-in call


@pytest.mark.parametrize("text, content, calls", LLAMA)
@pytest.mark.parametrize("chunks", [None, 1, 5])
def test_llama3(text, content, calls, chunks):
    got_content, got_calls = split(Llama3Format(), text, chunks)
    assert (got_content.strip(), got_calls) == (content, calls)


@pytest.mark.parametrize("text", LLAMA_BROKEN)
@pytest.mark.parametrize("chunks", [None, 3])
def test_llama3_malformed_calls_stay_text(text, chunks):
    assert split(Llama3Format(), text, chunks) == (text, [])


MISTRAL = [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc123xyz"}]', "",
     [("get_weather", {"city": "Paris"})]),
    ('Checking both.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Checking both.",
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]),
    ('[TOOL_CALLS]add[ARGS]{"a": 5, "b": 6}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', "",   # v11 style
     [("add", {"a": 5, "b": 6}), ("get_weather", {"city": "Lima"})]),
    ("Plain [TOOL answer]", "Plain [TOOL answer]", []),
]
MISTRAL_BROKEN = ['[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', '[TOOL_CALLS][]',
                  '[TOOL_CALLS]{"name": "add", "arguments": {}}', '[TOOL_CALLS]nope[ARGS]{}']


@pytest.mark.parametrize("text, content, calls", MISTRAL)
@pytest.mark.parametrize("chunks", [None, 1, 6])
def test_mistral(text, content, calls, chunks):
    got_content, got_calls = split(MistralFormat(), text, chunks)
    assert (got_content.strip(), got_calls) == (content, calls)


@pytest.mark.parametrize("text", MISTRAL_BROKEN)
def test_mistral_malformed_calls_stay_text(text):
    assert split(MistralFormat(), text, 2) == (text, [])


def test_a_call_id_the_model_wrote_is_kept():
    s = ToolStream(MistralFormat(), NAMES)
    s.feed('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abc123xyz"}]')
    s.finish()
    assert s.calls[0].id == "abc123xyz"


def test_closed_objects():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in schema   # the request's own schema is left alone


# -- the forcing grammars, on the embedded model's vocabulary -------------------------------

TOOLS = [ToolSpec("get_weather", closed_objects({"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]})),
         ToolSpec("add", closed_objects({"type": "object", "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}},
                                         "required": ["a", "b"]}))]


@pytest.fixture(scope="module")
def vocab():
    return GrammarVocab(Tokenizer.from_gguf(EMBEDDED))


def _accepts(vocab, grammar: str, text: str) -> bool:
    c = TokenConstraint(vocab, lark_grammar(grammar))
    ids = vocab.tokenizer.encode(text)
    stop = min(vocab.tokenizer.stop_ids)
    return c.valid_prefix(ids + [stop]) == len(ids) + 1    # all of it, and complete


# (format, one call, a second call after it) as each format writes them
CALLS = [
    (HermesFormat(), '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (Llama3Format(), '{"name": "add", "parameters": {"a": 1, "b": 2}}', None),
    (MistralFormat(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}',
     ', {"name": "get_weather", "arguments": {"city": "Paris"}}'),
]


@pytest.mark.parametrize("fmt, one, two", CALLS)
def test_forcing_grammars(vocab, fmt, one, two):
    close = "]" if isinstance(fmt, MistralFormat) else ""
    single = fmt.grammar(TOOLS, False, vocab)
    assert _accepts(vocab, single, one + close)
    assert fmt.decode(one + close, NAMES) is not None      # what the grammar forces, the parser reads
    assert not _accepts(vocab, single, one.replace('"a": 1', '"a": "one"') + close)   # arguments by schema
    assert not _accepts(vocab, single, one.replace('"add"', '"launch"') + close)      # only the tools offered
    assert not _accepts(vocab, single, "Sure. " + one + close)
    if two is not None:
        assert not _accepts(vocab, single, one + two + close)
        assert _accepts(vocab, fmt.grammar(TOOLS, True, vocab), one + two + close)
    named = fmt.grammar(TOOLS[1:], False, vocab)
    assert _accepts(vocab, named, one + close)
    assert not _accepts(vocab, named, one.replace('"name": "add"', '"name": "get_weather"') + close)


# -- the lazy grammars (tool_choice auto with strict tools) -------------------------------

@pytest.mark.parametrize("fmt, one, two", CALLS)
def test_lazy_grammars(vocab, fmt, one, two):
    """Free text is free; a call, alone or after text, follows its tool's schema; the
    marker's first bytes in ordinary text ("a < b", "[TOOL") do not start a call."""
    close = "]" if isinstance(fmt, MistralFormat) else ""
    lazy = fmt.lazy_grammar(TOOLS, True, vocab)
    for text in ("The weather is fine.", "a < b and <tool c [TOOL", one + close):
        assert _accepts(vocab, lazy, text), text
    assert not _accepts(vocab, lazy, one.replace('"a": 1', '"a": "one"') + close)    # arguments by schema
    assert not _accepts(vocab, lazy, one.replace('"add"', '"launch"') + close)       # only the tools offered
    if isinstance(fmt, Llama3Format):     # a call is the whole message: after text, JSON is text
        assert _accepts(vocab, lazy, "Sure. " + one) and fmt.decode("Sure. " + one, NAMES) is None
        return
    lead = "Let me add that.\n" + one + close
    assert _accepts(vocab, lazy, lead) and fmt.decode(lead[lead.index(one[:3]):], NAMES) is not None
    assert not _accepts(vocab, lazy, "Let me add that.\n" + one.replace('"b": 2', '"b": 2.5') + close)
    assert _accepts(vocab, lazy, one + two + close)
    assert not _accepts(vocab, fmt.lazy_grammar(TOOLS, False, vocab), one + two + close)
    if isinstance(fmt, HermesFormat):     # an untagged call (Qwen2.5-Coder's) is held to the schema too
        bare = one[len(fmt.OPEN) + 1:-len(fmt.CLOSE) - 1]
        assert _accepts(vocab, lazy, bare) and fmt.decode(bare, NAMES) is not None
        assert not _accepts(vocab, lazy, bare.replace('"a": 1', '"a": "one"'))
        assert not _accepts(vocab, lazy, '{"name": "launch", "arguments": {}}')
        # after text the untagged form is not free text: schema-checked calls are tagged there
        assert not _accepts(vocab, lazy, "Sure:\n" + bare)
        assert not _accepts(vocab, lazy, "Sure:\n" + bare + two)
        assert _accepts(vocab, lazy, "int main()\n{\n  return 0;\n}")

"""gpt-oss's harmony answers (server/harmony.py and tool_formats.HarmonyFormat) on
hand-written outputs in every chunking: analysis to reasoning_content, final to content,
calls to tool_calls, a malformed call left as the text of its message; the template
picks the format; the forcing grammars on a tiny vocabulary with harmony's tokens."""
from __future__ import annotations

import json

import pytest
from test_tool_formats import (
    TOOLS,  # the same two tools as the other formats' grammar tests
)

from alphallama.grammar import GrammarVocab, TokenConstraint, lark_grammar
from alphallama.server import harmony as hm
from alphallama.server.chat_output import ToolChatFormat
from alphallama.server.harmony import HarmonyStream
from alphallama.server.tool_formats import HarmonyFormat, format_for_template
from alphallama.server.tool_stream import ToolStream

NAMES = frozenset({"get_weather", "add"})
TAIL = "<|end|><|start|>assistant"            # where gpt-oss's generation prompt leaves the answer
A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
WEATHER = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
ADD_IN_ROLE = ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}'   # recipient after the role

# text after the prompt, reasoning, content, calls
CASES = [
    (A + "They ask 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
     "They ask 2+2. Easy.", "It is 4.", []),
    (A + "Need the weather; a < b." + NEXT + WEATHER, "Need the weather; a < b.", "",
     [("get_weather", {"city": "Paris"})]),
    (A + "Two calls." + NEXT + WEATHER + "<|call|><|start|>assistant" + ADD_IN_ROLE, "Two calls.", "",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    (ADD_IN_ROLE, "", "", [("add", {"a": 1, "b": 2})]),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + WEATHER, "", "Checking.",
     [("get_weather", {"city": "Paris"})]),             # a preamble: commentary without a recipient
    ("Just plain text, <|no markers.", "", "Just plain text, <|no markers.", []),
    ("<|channel|>final<|message|>Hi.", "", "Hi.", []),
    (A + "cut off while thin", "cut off while thin", "", []),
    (A + "x" + NEXT + "<|channel|>fin", "x", "", []),             # cut in a header: nothing of it
    (A + "x" + NEXT + " says hello, no header", "x", "assistant says hello, no header", []),   # kept
    ("", "", "", []),
]
BROKEN = [   # the message as written stays content (the prompt wrote the first one's <|start|>assistant)
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par',
     '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Par'),
    ("<|channel|>commentary to=functions.launch_rockets <|constrain|>json<|message|>{}",
     "<|start|>assistant<|channel|>commentary to=functions.launch_rockets <|constrain|>json<|message|>{}"),
    (A + "hm" + NEXT + "<|channel|>commentary to=functions.add <|constrain|>json<|message|>[1, 2]",
     "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>[1, 2]"),
    ("<|channel|>commentary to=python<|message|>print(1)",     # a built-in tool: not a function
     "<|start|>assistant<|channel|>commentary to=python<|message|>print(1)"),
    ("<|channel|>commentary to=functions.add <|constrai",      # cut in its header
     "<|start|>assistant<|channel|>commentary to=functions.add <|constrai"),
]


def _all_chunkings(text: str):
    """The whole text, one character at a time, and cut at every point into two."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def split(pieces, split_reasoning=True):
    """(reasoning, content, [(name, arguments)]): the splitter, then the ToolStream, as
    ToolChatFormat chains them."""
    h, t = HarmonyStream(TAIL, split_reasoning), ToolStream(HarmonyFormat(), NAMES)
    reasoning, content = [], []
    for i, p in enumerate([*pieces, None]):
        r, c = h.feed(p) if p is not None else h.finish()
        c2, _ = t.feed(c)
        if p is None:
            tail, _ = t.finish()
            c2 += tail
        reasoning.append(r)
        content.append(c2)
    assert h.reasoning == "".join(reasoning)
    return "".join(reasoning), "".join(content), [(c.name, json.loads(c.arguments)) for c in t.calls]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_split_in_every_chunking(text, reasoning, content, calls):
    for pieces in _all_chunkings(text) if text else [[]]:
        assert split(pieces) == (reasoning, content, calls), pieces


@pytest.mark.parametrize("text, content", BROKEN)
def test_malformed_calls_stay_text(text, content):
    reasoning = "hm" if text.startswith(A) else ""
    for pieces in _all_chunkings(text):
        assert split(pieces) == (reasoning, content, []), pieces


def test_reasoning_format_none_leaves_analysis_in_content():
    text = A + "Think." + NEXT + "<|channel|>final<|message|>Done."
    for pieces in _all_chunkings(text):
        assert split(pieces, split_reasoning=False) == ("", A + "Think.<|end|>Done.", []), pieces


def test_a_prompt_that_opens_the_body():
    h = HarmonyStream("<|start|>assistant<|channel|>final<|message|>")
    assert h.feed("<|channel|>is text here") == ("", "<|channel|>is text here")
    h, t = HarmonyStream("<|start|>assistant to=functions.add<|channel|>commentary<|message|>"), \
        ToolStream(HarmonyFormat(), NAMES)
    t.feed(h.feed('{"a": 1, "b": 2}')[1])
    t.feed(h.finish()[1])
    assert t.finish()[0] == "" and [c.name for c in t.calls] == ["add"]


def test_format_found_from_the_template():
    harmony = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
               "{% if m.tool_calls %}<|channel|>commentary to=functions.{{ name }}{% endif %}<|start|>assistant")
    assert isinstance(format_for_template(harmony), HarmonyFormat) and hm.is_harmony(harmony)
    assert not hm.is_harmony("{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>{% endfor %}")


def test_chat_chunks_and_response():
    """OpenAI's shapes: reasoning_content and tool_calls deltas, finish_reason tool_calls."""
    from conftest import STORIES

    from alphallama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(STORIES)
    text = A + "Weather first." + NEXT + WEATHER

    def fmt():
        return ToolChatFormat("m", tok, False, ToolStream(HarmonyFormat(), NAMES), HarmonyStream(TAIL))
    f = fmt()
    chunks = [f.chunk(text[i:i + 9], [], None) for i in range(0, len(text), 9)] + [f.chunk(None, [], "stop")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather first."
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = fmt().response(text, None, "stop", {}, {})["choices"][0]
    m = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and m["content"] is None
    assert m["reasoning_content"] == "Weather first." and m["tool_calls"][0]["function"]["name"] == "get_weather"
    final = fmt().response(A + "x" + NEXT + "<|channel|>final<|message|>Sunny.", None, "stop", {}, {})["choices"][0]
    assert final["finish_reason"] == "stop" and final["message"]["content"] == "Sunny."


# -- the forcing grammars, on a tiny byte-level vocabulary with harmony's tokens -----------------



@pytest.fixture(scope="module")
def vocab():
    """No committed vocabulary has harmony's tokens: the repo's synthetic byte-level vocabulary
    with them appended, typed control as gpt-oss's GGUF types them (the tokenizer then makes
    all but <|call|> and <|return|> user-defined, as llama.cpp does: those two end generation)."""
    from alphallama.gguf.synth_vocab import byte_vocab
    from alphallama.tokenizer import Tokenizer, TokenType
    md = {kv.key: kv.value for kv in byte_vocab(258)}
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + list(hm.MARKERS)
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [int(TokenType.CONTROL)] * len(hm.MARKERS)
    tok = Tokenizer.from_metadata(md)
    assert {tok.id_of(m) for m in (hm.CALL, hm.RETURN)} <= tok.stop_ids
    assert len(tok.encode(A)) == len("analysis") + 2          # the markers are single tokens
    return GrammarVocab(tok)


def _accepts(vocab, grammar: str, text: str) -> bool:
    c = TokenConstraint(vocab, lark_grammar(grammar))
    ids = vocab.tokenizer.encode(text)
    return c.valid_prefix(ids + [vocab.tokenizer.id_of(hm.CALL)]) == len(ids) + 1    # all of it, then <|call|>


CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}'


def test_forcing_grammar(vocab):
    f = HarmonyFormat()
    forced = f.grammar(TOOLS, True, vocab)
    for text in (CALL, A + "Add them." + NEXT + CALL):
        assert _accepts(vocab, forced, text), text
        assert split([text])[2] == [("add", {"a": 1, "b": 2})]    # what the grammar forces, the parser reads
    assert not _accepts(vocab, forced, CALL.replace('"a": 1', '"a": "one"'))       # arguments by schema
    assert not _accepts(vocab, forced, CALL.replace('"b": 2', '"b": 2, "c": 3'))   # closed objects
    assert not _accepts(vocab, forced, CALL.replace("add", "launch"))              # only the tools offered
    assert not _accepts(vocab, forced, "<|channel|>final<|message|>No call.")
    assert not _accepts(vocab, forced, CALL + NEXT + CALL)                          # one call a turn
    named = f.grammar(TOOLS[1:], False, vocab)
    assert _accepts(vocab, named, CALL) and not _accepts(vocab, named, WEATHER)


def test_lazy_grammar(vocab):
    lazy = HarmonyFormat().lazy_grammar(TOOLS, True, vocab)
    for text in ("<|channel|>final<|message|>Free text.", A + "hm" + NEXT + CALL, ADD_IN_ROLE.lstrip(), CALL):
        assert _accepts(vocab, lazy, text), text
    assert not _accepts(vocab, lazy, A + "hm" + NEXT + CALL.replace('"a": 1', '"a": 1.5'))
    assert not _accepts(vocab, lazy, CALL.replace("add", "launch"))


HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if tools %}<|channel|>commentary to=functions.{% endif %}<|start|>assistant")


def _engine(vocab):
    """What ChatOutput asks of an engine, with the tiny harmony vocabulary."""
    from types import SimpleNamespace
    tok = vocab.tokenizer
    return SimpleNamespace(tokenizer=tok, grammar_vocab=vocab, chat_template=SimpleNamespace(source=HARMONY_TEMPLATE),
                           encode_chat=lambda messages, **kw: tok.encode("<|start|>user<|message|>hi" + TAIL))


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_chat_output_picks_harmony(vocab, choice):
    """From the template: the harmony splitter (with or without tools), its markers rendered by
    the detokenizer and <|call|> not, and the forcing grammar in harmony's shape."""
    from alphallama.server.chat_output import ChatOutput
    from alphallama.server.schemas import ChatRequest
    from alphallama.server.tool_stream import ShownSpecials
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in TOOLS]
    out = ChatOutput(ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice))
    engine = _engine(vocab)
    out.prompt_ids(engine)
    fmt = out.format("m", engine.tokenizer, False)
    assert isinstance(fmt.thinking, HarmonyStream)
    assert (out.constraint is not None) == (choice == "required")
    if choice == "none":
        assert not isinstance(fmt, ToolChatFormat)
    else:
        assert isinstance(fmt.stream.fmt, HarmonyFormat)
    tok = engine.tokenizer
    ids = tok.encode(A + "hm" + NEXT + CALL) + [tok.id_of(hm.CALL)]
    detok = ShownSpecials(tok, out.shown_tokens) if out.shown_tokens else tok.stream()
    assert "".join(map(detok.feed, ids)) + detok.flush() == A + "hm" + NEXT + CALL
    if out.constraint is not None:
        assert out.constraint.valid_prefix(ids) == len(ids)

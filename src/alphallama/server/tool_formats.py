"""How model families write tool calls: one class per format, chosen from the chat template.

A format knows three things: whether a template is its own (the markers the template
emits, never the model's file name), where a call starts and ends in the model's output
(`span`, used while streaming and at the end), how a call's text decodes into calls
(`decode`: None when it is malformed, and the caller then returns that text as content),
and the Lark grammar that forces calls when tool_choice asks for them.

- Hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  an answer that is nothing but such objects, bare or in a ```json fence, is calls too, and
  so is an answer's end from a line that opens `{"name"` after text ("Sure:\n{...}")
  (Qwen2.5-Coder writes them without the tags under tool_choice auto; llama.cpp's Hermes
  parser takes them as well; a call amid prose stays text)
- Llama 3.x JSON: the whole answer is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` repeated
- gpt-oss harmony: `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
  as server/harmony.py's splitter hands a call message on

`markers` are the format's control tokens that the detokenizer must render for `span` to see.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from ..grammar import GrammarVocab, lark_json
from . import harmony as hm
from .textstream import marker_tail


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                  # JSON text of an object
    id: str = field(default_factory=_call_id)


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the grammar needs it."""
    name: str
    parameters: dict


def _partial_marker(text: str, marker: str) -> int | None:
    """Where a proper prefix of `marker` ends `text` (it may still become the marker)."""
    k = marker_tail(text, (marker,))
    return len(text) - k if k else None


def _delimited_span(text: str, open_: str, close: str, final: bool) -> tuple[int, int | None] | None:
    """ToolFormat.span of calls written open_ ... close (Hermes' tags, harmony's call messages)."""
    i = text.find(open_)
    if i < 0:
        k = None if final else _partial_marker(text, open_)
        return None if k is None else (k, None)
    j = text.find(close, i)
    if j >= 0:
        return i, j + len(close)
    return (i, len(text)) if final else (i, None)


def _call(obj, names: frozenset[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": ..., <args key>: {...} or its JSON text} -> a call of a known function."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id")
    extra = {"id": call_id} if isinstance(call_id, str) and call_id else {}
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), **extra)


def _checked(calls: list[ToolCall | None]) -> list[ToolCall] | None:
    """The calls, or None when there are none or any is malformed (the text stays content)."""
    return calls if calls and all(c is not None for c in calls) else None


def _json_values(text: str, sep: str = "") -> list | None:
    """The JSON values `text` is made of (whitespace and `sep` between them), or None."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _marker(vocab: GrammarVocab, text: str) -> str:
    """A marker in a grammar: its control token by id where the vocabulary has one, else text."""
    tid = vocab.special_token(text)
    return f"<[{tid}]>" if tid is not None else _lit(text)


def _call_rules(tools: list[ToolSpec], args_key: str) -> list[str]:
    """`call: c0 | c1 ...` with each ci the call's JSON: its name fixed, its arguments by schema."""
    rules = ["call: " + " | ".join(f"c{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        head = _lit('{"name": ' + json.dumps(t.name) + f', "{args_key}": ')
        rules.append(f'c{i}: {head} a{i} "}}"')
        rules.append(f"a{i}: {lark_json(t.parameters)}")
    return rules


ANY_TEXT = "/(.|\\n)+/"
NOT_JSON = "/[^{\\s](.|\\n)*/"      # text that cannot open as a call's JSON (nor with whitespace)
LINE_CALL = '\\n\\s*(```(json)?\\s*)?\\{\\s*"name"'   # nor hold an untagged call's head after text


def _free_text(base: str, *markers: str, never: str = "") -> str:
    """A lazy grammar's free text: `base` text that never spells a call's marker (nor
    matches the regex `never`)."""
    banned = [re.escape(m) for m in markers] + ([never] if never else [])
    return f"{base} & ~/(.|\\n)*({'|'.join(banned)})(.|\\n)*/" if banned else base


def _lazy(vocab: GrammarVocab, marker: str, after: str, rules: list[str], bare: str | None = None) -> str:
    """Free text, or text up to a call's marker and then `after` (the calls past the marker).
    A marker the vocabulary has as a control token cannot be spelled by text; a textual one
    ends the free text as a `suffix` (llguidance: the text runs lazily until it, the marker
    then part of the output): a greedy text lexeme would swallow the marker's first bytes.
    bare: the calls written without the marker, as a whole answer; free text then may not
    start with "{" (nor whitespace, nor may the text before a marker start with "{") nor hold
    a line that opens an untagged call, so an answer that holds one is a call by the schema."""
    tid = vocab.special_token(marker)
    text, lead, alt = (NOT_JSON, "/([^{](.|\\n)*)?/", f" | {bare}") if bare else (ANY_TEXT, "/(.|\\n)*/", "")
    never = LINE_CALL if bare else ""
    if tid is not None:
        return "\n".join([f"start: TEXT | TEXT? <[{tid}]> {after}{alt}", f"TEXT: {_free_text(text, never=never)}",
                          *rules])
    return "\n".join([f"start: TEXT | lead {after}{alt}", f"TEXT: {_free_text(text, marker, never=never)}",
                      f"lead[suffix={_lit(marker)}]: {_free_text(lead, never=never)}", *rules])


class ToolFormat(Protocol):
    name: str
    markers: tuple[str, ...]

    def detect(self, template: str) -> bool: ...

    def span(self, text: str, at_start: bool, final: bool) -> tuple[int, int | None] | None:
        """The first call in `text`: (start, end) once complete; (start, None) while it may
        still be going on (or a marker may be starting); None when there is none. With
        final, text is all there is: an unfinished call runs to its end."""

    def decode(self, text: str, names: frozenset[str]) -> list[ToolCall] | None: ...

    def grammar(self, tools: list[ToolSpec], parallel: bool, vocab: GrammarVocab) -> str:
        """Lark: the calls alone (tool_choice required or named)."""

    def lazy_grammar(self, tools: list[ToolSpec], parallel: bool, vocab: GrammarVocab) -> str:
        """Lark: free text, or (text and) the calls, each call as `grammar` takes it
        (tool_choice auto with strict tools: the text is free until a call starts)."""


class HermesFormat:
    name = "hermes"
    markers = ()
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FENCES = ("```json", "```")                     # around an untagged call
    # (the head an untagged call opens with, the text that may still become it): at the answer's
    # start any object; after text, a line that opens {"name"
    ANY_OBJECT = ("\\{", "")
    NAMED = ('\\{\\s*"name"', '(\\{\\s*("(n(a(m(e)?)?)?)?)?)?')

    def detect(self, template: str) -> bool:
        return self.OPEN in template

    def span(self, text, at_start, final):
        tagged = _delimited_span(text, self.OPEN, self.CLOSE, final)
        if tagged is not None and tagged[1] is not None:
            return tagged
        if at_start:
            body = text.lstrip()
            if self._head(body, final, self.ANY_OBJECT):
                return len(text) - len(body), len(text) if final else None
        for line in re.finditer("\n", text):          # calls after text, from a line's start
            head = self._head(text[line.end():].lstrip(), final, self.NAMED)
            if head and (tagged is None or line.start() < tagged[0]):
                return line.start(), len(text) if final else None
        return tagged

    def _head(self, body: str, final: bool, head: tuple[str, str]) -> bool | None:
        """Whether `body` opens untagged calls (True: held to the answer's end, decoded
        whole), may still open them (True while not final), or does not (None); head: the
        (opening, may-still-open) patterns, ANY_OBJECT or NAMED."""
        if any(f.startswith(body) for f in self.FENCES):
            return None if final else True          # nothing yet, or a fence's start
        fence = next((f for f in self.FENCES if body.startswith(f)), None)
        inner = body[len(fence):].lstrip() if fence else body
        if re.match(head[0], inner):
            return True
        return None if final or re.fullmatch(head[1], inner) is None else True

    def decode(self, text, names):
        if not text.startswith(self.OPEN):          # untagged (span saw a call's head)
            return self._bare(text, names)
        body = text[len(self.OPEN):]
        if body.endswith(self.CLOSE):
            body = body[:-len(self.CLOSE)]
        values = _json_values(body)
        if not values or len(values) != 1:
            return None
        call = _call(values[0], names, ("arguments", "parameters"))
        return None if call is None else [call]

    def _bare(self, text, names):
        body = text.strip()
        fence = next((f for f in self.FENCES if body.startswith(f)), None)
        if fence is not None:
            if not body.endswith("```") or len(body) < len(fence) + 3:
                return None
            body = body[len(fence):-3]
        return _checked([_call(v, names, ("arguments", "parameters")) for v in _json_values(body) or []])

    def grammar(self, tools, parallel, vocab):
        return "\n".join(["start: calls", *self._rules(tools, parallel, vocab)])

    def lazy_grammar(self, tools, parallel, vocab):
        first = f'"\\n" call "\\n" {_marker(vocab, self.CLOSE)}' + (' ("\\n" tc)*' if parallel else "")
        bare = 'call ("\\n" call)*' if parallel else "call"      # an untagged answer (decode's _bare)
        return _lazy(vocab, self.OPEN, first, self._rules(tools, parallel, vocab)[1:], bare)

    def _rules(self, tools, parallel, vocab) -> list[str]:
        one = f'{_marker(vocab, self.OPEN)} "\\n" call "\\n" {_marker(vocab, self.CLOSE)}'
        calls = 'calls: tc ("\\n" tc)*' if parallel else "calls: tc"
        return [calls, f"tc: {one}", *_call_rules(tools, "arguments")]


class Llama3Format:
    name = "llama3-json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def detect(self, template: str) -> bool:
        return self.TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template)

    def span(self, text, at_start, final):
        i = text.find(self.TAG)
        if i >= 0:
            return (i, len(text)) if final else (i, None)
        if at_start:
            body = text.lstrip()
            lead = len(text) - len(body)
            if body.startswith("{"):
                return (lead, len(text)) if final else (lead, None)
            if not final and (not body or self.TAG.startswith(body)):
                return lead, None
        k = None if final else _partial_marker(text, self.TAG)
        return None if k is None else (k, None)

    def decode(self, text, names):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        return _checked([_call(v, names, ("parameters", "arguments")) for v in _json_values(body, sep=";") or []])

    def grammar(self, tools, parallel, vocab):
        # Llama 3.1's template takes one call per assistant message: one call, parallel or not.
        return "\n".join(["start: call", *_call_rules(tools, "parameters")])

    def lazy_grammar(self, tools, parallel, vocab):
        # a call is the whole message (JSON from its first character, as span reads it): text
        # is anything else, never starting with "{" nor spelling the python tag
        text = _free_text(NOT_JSON, self.TAG)
        return "\n".join(["start: TEXT | call", f"TEXT: {text}", *_call_rules(tools, "parameters")])


class MistralFormat:
    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (MARK, ARGS)

    def detect(self, template: str) -> bool:
        return self.MARK in template

    def span(self, text, at_start, final):
        i = text.find(self.MARK)
        if i < 0:
            k = None if final else _partial_marker(text, self.MARK)
            return None if k is None else (k, None)
        return (i, len(text)) if final else (i, None)   # the calls run to the end of the answer

    def decode(self, text, names):
        parts = [p for p in text.split(self.MARK) if p.strip()]
        calls: list[ToolCall | None] = []
        for part in parts:
            if self.ARGS in part:                        # name[ARGS]{...}
                name, _, args = part.partition(self.ARGS)
                values = _json_values(args)
                if not values or len(values) != 1:
                    return None
                calls.append(_call({"name": name.strip(), "arguments": values[0]}, names, ("arguments",)))
            else:                                        # [{...}, ...]
                values = _json_values(part)
                if not values or len(values) != 1 or not isinstance(values[0], list) or not values[0]:
                    return None
                calls += [_call(v, names, ("arguments", "parameters")) for v in values[0]]
        return _checked(calls)

    def grammar(self, tools, parallel, vocab):
        return "\n".join(["start: calls", *self._rules(tools, parallel, vocab)])

    def lazy_grammar(self, tools, parallel, vocab):
        items = 'call (", " call)*' if parallel else "call"
        return _lazy(vocab, self.MARK, f'"[" {items} "]"', _call_rules(tools, "arguments"))

    def _rules(self, tools, parallel, vocab) -> list[str]:
        items = 'call (", " call)*' if parallel else "call"
        return [f'calls: {_marker(vocab, self.MARK)} "[" {items} "]"', *_call_rules(tools, "arguments")]


class HarmonyFormat:
    """gpt-oss: a call is a message to `functions.NAME` whose body is the arguments' JSON.
    One call per turn: `<|call|>` ends the turn (an end-of-generation token), so a forced
    call is one call, parallel or not. The forcing grammar lets the model reason first
    (one analysis message: gpt-oss answers badly without it), then writes the call's header
    as the model does; the arguments end the grammar and the model's `<|call|>` ends the turn."""
    name = "harmony"
    markers = hm.MARKERS
    _NAME = re.compile(r"\bto=functions\.([^\s<]+)")

    def detect(self, template: str) -> bool:
        return hm.is_harmony(template)

    def span(self, text, at_start, final):   # the splitter opens every call message with <|start|>
        return _delimited_span(text, hm.START, hm.CALL, final)

    def decode(self, text, names):
        head, sep, body = text.removeprefix(hm.START).partition(hm.MESSAGE)
        name = self._NAME.search(head)
        if not text.startswith(hm.START) or not sep or name is None:
            return None
        values = _json_values(body.removesuffix(hm.CALL))
        if not values or len(values) != 1:
            return None
        call = _call({"name": name.group(1), "arguments": values[0]}, names, ("arguments",))
        return None if call is None else [call]

    def grammar(self, tools, parallel, vocab):
        m = {k: _marker(vocab, k) for k in hm.MARKERS}
        end = vocab.special_token(hm.END)
        thought = (["thought: THOUGHT? " + m[hm.END], "THOUGHT: /(.|\\n)+/"] if end is not None
                   else [f"thought[suffix={_lit(hm.END)}]: /(.|\\n)*/"])
        return "\n".join([
            "start: analysis? call",
            f'analysis: {m[hm.CHANNEL]} "analysis" {m[hm.MESSAGE]} thought {m[hm.START]} "assistant"',
            *thought,
            f'call: {m[hm.CHANNEL]} "commentary to=functions." tc',
            *self._calls(tools, f'" " {m[hm.CONSTRAIN]} "json" {m[hm.MESSAGE]}')])

    def lazy_grammar(self, tools, parallel, vocab):
        # the call's marker is its recipient, plain text in the header (written after the
        # role or after the channel); the header's rest as either place writes it
        m = {k: _marker(vocab, k) for k in hm.MARKERS}
        rest = f'" "? ({m[hm.CHANNEL]} "commentary" " "?)? ({m[hm.CONSTRAIN]}? "json")? {m[hm.MESSAGE]}'
        return _lazy(vocab, "to=functions.", "tc", self._calls(tools, rest))

    @staticmethod
    def _calls(tools, rest: str) -> list[str]:
        """`tc`: a tool's name, the header's rest, its arguments by schema."""
        rules = ["tc: " + " | ".join(f"c{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            rules += [f"c{i}: {_lit(t.name)} {rest} a{i}", f"a{i}: {lark_json(t.parameters)}"]
        return rules


# Checked in order: the first whose markers the template emits is the model's format.
TOOL_FORMATS: tuple[ToolFormat, ...] = (HarmonyFormat(), HermesFormat(), MistralFormat(), Llama3Format())


def format_for_template(template: str) -> ToolFormat | None:
    return next((f for f in TOOL_FORMATS if f.detect(template)), None)

"""The model's text split into content and tool calls as it streams.

Content is passed on as soon as it cannot be the start of a call; text from a call's
start is held until the format says the call is complete, then decoded: into calls, or,
when it is malformed (bad JSON, an unknown function), back into content as it was
written. Nothing sent is ever taken back, and at the end every held character is either
content or part of a call.
"""
from __future__ import annotations

from ..tokenizer import Tokenizer
from .tool_formats import ToolCall, ToolFormat


class ToolStream:
    def __init__(self, fmt: ToolFormat, names: frozenset[str]):
        self.fmt = fmt
        self.names = names
        self._buf = ""
        self._pos = 0                  # characters of _buf already given out (content or calls)
        self._content_sent = False     # a format may only start a call at the answer's start
        self.calls: list[ToolCall] = []

    def _scan(self, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while self._pos < len(self._buf):
            rest = self._buf[self._pos:]
            at_start = not self._content_sent and not self.calls and not calls and not "".join(content).strip()
            span = self.fmt.span(rest, at_start, final)
            if span is None:
                content.append(rest)
                self._pos = len(self._buf)
                break
            start, end = span
            content.append(rest[:start])
            if end is None:            # held: a call (or a marker) still being written
                self._pos += start
                break
            decoded = self.fmt.decode(rest[start:end], self.names)
            if decoded is None:
                content.append(rest[start:end])
            else:
                calls += decoded
            self._pos += end
        text = "".join(content)
        if text.strip():
            self._content_sent = True
        self.calls += calls
        return text, calls

    def feed(self, piece: str) -> tuple[str, list[ToolCall]]:
        """Content that is safe to send now, and the calls completed by this piece."""
        self._buf += piece
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Everything still held, once the model has stopped."""
        return self._scan(final=True)


class ShownSpecials:
    """A detokenizer that renders the given control tokens as their text (a format's
    markers such as [TOOL_CALLS] or <|python_tag|>) and the other control tokens as nothing."""

    def __init__(self, tokenizer: Tokenizer, shown: frozenset[int]):
        self._plain = tokenizer.stream()
        self._shown = shown
        self._tokenizer = tokenizer

    def feed(self, token_id: int) -> str:
        if token_id in self._shown:
            return self._plain.flush() + self._tokenizer.token_to_piece(token_id, special=True).decode()
        return self._plain.feed(token_id)

    def flush(self) -> str:
        return self._plain.flush()

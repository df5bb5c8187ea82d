"""gpt-oss's "harmony" answer split into reasoning, content and call messages as it streams.

A harmony turn is a sequence of messages, each `<|start|>ROLE HEADER<|message|>BODY` ended
by `<|end|>` (more messages follow), `<|call|>` (a tool call: the turn ends) or
`<|return|>` (the turn ends). The prompt's generation prompt writes the first message's
`<|start|>assistant`, so the output begins with the rest of its header:

    <|channel|>analysis<|message|>We need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The header's channel picks where the body goes: `analysis` is reasoning (reasoning_content;
with --reasoning-format none, content as written), `final` and `commentary` without a
recipient are content. A message with a recipient (`to=functions.NAME`, in the header's
role part or after its channel) is a tool call: it goes on, as content, in one shape,
`<|start|>HEADER<|message|>ARGS<|call|>`, for the ToolStream's HarmonyFormat to decode
(tool_formats.py); a call it cannot decode stays that text. Output that does not begin
like a header (a model that ignores the format) is content as it is; so is text after a
`<|start|>` that never reaches `<|message|>`, where a header cut short (`<|channel|>fin` at
max_tokens) is dropped.

The markers are tokens of gpt-oss's vocabulary; the detokenizer renders them (the
tokenizer types most of them user-defined, ChatOutput's shown_tokens the others).
Nothing sent is taken back: text that may be the start of a marker is held until it is not.
"""
from __future__ import annotations

import re

from .textstream import marker_tail

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)
_HEAD_OPENERS = (START, CHANNEL, CONSTRAIN, MESSAGE, "to=")   # what a header written by the model starts with
_BODY_ENDS = (END, CALL, RETURN, START)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_BARE_HEAD = re.compile(r"\s*(\w+\s*)?(<\|channel\|>\s*\w*\s*)?(<\|constrain\|>\s*\w*\s*)?")   # role, channel, type


def is_harmony(template: str | None) -> bool:
    """Does the chat template write harmony messages?"""
    return bool(template) and CHANNEL in template and MESSAGE in template


class HarmonyStream:
    """feed(piece) -> (reasoning, content) safe to send now; finish() -> the rest. The same
    face as reasoning.ReasoningStream, so ChatFormat and ToolChatFormat take either."""

    def __init__(self, prompt_tail: str = "", split_reasoning: bool = True):
        self._split = split_reasoning
        self._buf = ""
        self.reasoning = ""            # all of it, for the non-streamed message
        self._route = "content"        # where the open body goes: reasoning | content | call | raw
        i = prompt_tail.rfind(START)
        head = prompt_tail[i + len(START):] if i >= 0 else ""
        self._head, self._fresh = head, True    # fresh: the model has written none of this header
        self._mode = "head"
        self._opening = ""             # content the first scan starts with
        if MESSAGE in head:            # the prompt opened the body itself
            self._mode, self._fresh = "body", False
            self._head = head[:head.index(MESSAGE)]
            self._opening = self._open_body(self._head)

    def feed(self, piece: str) -> tuple[str, str]:
        self._buf += piece
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(final=True)

    def _open_body(self, head: str) -> str:
        """Route the body of a message with this header; the content that opens it."""
        channel = _CHANNEL.search(head)
        channel = channel.group(1) if channel else None
        if _RECIPIENT.search(head):
            self._route = "call"
            return START + head + MESSAGE
        if channel == "analysis":
            self._route = "reasoning" if self._split else "raw"
            return "" if self._split else head[head.find(CHANNEL):] + MESSAGE
        self._route = "content"
        return ""

    def _close_body(self) -> str:
        """The content that closes the open body: a call's `<|call|>`, a raw message's `<|end|>`."""
        return {"call": CALL, "raw": END}.get(self._route, "")

    def _scan(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], [self._opening]
        self._opening = ""
        while self._buf:
            if self._mode == "head" and self._fresh:
                body = self._buf.lstrip()
                if body.startswith(START):                   # a new message: its role comes next
                    self._buf, self._head, self._fresh = body[len(START):], "", False
                    continue
                if body.startswith(_HEAD_OPENERS):
                    self._fresh = False
                    continue
                if not final and any(o.startswith(body) for o in _HEAD_OPENERS):
                    break                                    # may still become a header
                self._mode, self._route = "body", "content"  # not harmony: text as it is
                continue
            if self._mode == "head":
                j = self._buf.find(MESSAGE)
                if j < 0:
                    if not final:
                        break
                    if _RECIPIENT.search(self._head + self._buf):     # a call cut in its header
                        content.append(START + self._head + self._buf)
                    elif not _BARE_HEAD.fullmatch(self._buf):         # not a header after all: text
                        content.append(self._buf)
                    self._buf = ""                                    # (a header cut short: nothing)
                    break
                self._head += self._buf[:j]
                self._buf, self._mode = self._buf[j + len(MESSAGE):], "body"
                content.append(self._open_body(self._head))
                continue
            ends = [(i, m) for m in _BODY_ENDS if (i := self._buf.find(m)) >= 0]
            if ends:
                j, marker = min(ends)
                text, closing = self._buf[:j], self._close_body()
                self._buf = self._buf[j if marker == START else j + len(marker):]
                self._mode, self._head, self._fresh = "head", "", True
            else:
                cut = len(self._buf) - (0 if final else marker_tail(self._buf, _BODY_ENDS))
                text, closing, self._buf = self._buf[:cut], "", self._buf[cut:]
            (reasoning if self._route == "reasoning" else content).append(text)
            content.append(closing)
            if not ends:
                break
        r = "".join(reasoning)
        self.reasoning += r
        return r, "".join(content)

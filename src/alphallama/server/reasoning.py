"""A thinking model's reasoning split from its answer: `reasoning_content` beside `content`.

Qwen3 / Qwen3.5, DeepSeek-R1 and their distills write `<think>...</think>` before the
answer. As llama-server does (`--reasoning-format deepseek`, its default through `auto`),
the text inside goes to `message.reasoning_content` (in a stream, `delta.reasoning_content`)
and `content` holds the answer alone; `none` leaves the tags in `content`. The tags are
the template's: a template that never writes `<think>` gets no split. A prompt that ends
inside an open `<think>` (templates that open it in the generation prompt) starts the
answer in reasoning; an answer that starts with `<think>` (after whitespace) enters it.
Nothing sent is taken back: text that may be the start of a tag is held until it is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .textstream import marker_tail

REASONING_FORMATS = ("auto", "deepseek", "none")


class Thinking(Protocol):
    """A splitter of the answer into (reasoning, content): ReasoningStream here, or
    harmony.HarmonyStream for gpt-oss's channels."""
    reasoning: str

    def feed(self, piece: str) -> tuple[str, str]: ...
    def finish(self) -> tuple[str, str]: ...


@dataclass(frozen=True)
class ThinkTags:
    open: str = "<think>"
    close: str = "</think>"

    def open_at_end(self, prompt_tail: str) -> bool:
        """Does a prompt ending with `prompt_tail` leave a think block open?"""
        return prompt_tail.rfind(self.open) > prompt_tail.rfind(self.close)


def reasoning_tags(template: str | None, fmt: str) -> ThinkTags | None:
    """The tags to split on: the template writes them and the format asks for the split."""
    tags = ThinkTags()
    if fmt == "none" or not template or tags.open not in template or tags.close not in template:
        return None
    return tags


class ReasoningStream:
    """feed(piece) -> (reasoning, content) safe to send now; finish() -> the rest."""

    def __init__(self, tags: ThinkTags, inside: bool):
        self.tags = tags
        self._mode = "reasoning" if inside else "start"   # start | reasoning | answer
        self._buf = ""
        self._lead = True          # the answer's leading whitespace after </think> is dropped
        self.reasoning = ""        # all of it, for the non-streamed message

    def feed(self, piece: str) -> tuple[str, str]:
        self._buf += piece
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            if self._mode == "start":
                body = self._buf.lstrip()
                if body.startswith(self.tags.open):
                    self._buf, self._mode = body[len(self.tags.open):], "reasoning"
                    continue
                if not final and (not body or self.tags.open.startswith(body)):
                    break                                   # may still become <think>
                self._mode, self._lead = "answer", False
                continue
            if self._mode == "reasoning":
                end = self._buf.find(self.tags.close)
                if end >= 0:
                    reasoning.append(self._buf[:end])
                    self._buf, self._mode = self._buf[end + len(self.tags.close):], "answer"
                    continue
                cut = len(self._buf) - (0 if final else marker_tail(self._buf, (self.tags.close,)))
                reasoning.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            if self._lead:                                  # the answer after </think>
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._lead = False
            content.append(self._buf)
            self._buf = ""
        r = "".join(reasoning)
        self.reasoning += r
        return r, "".join(content)

"""Generated tokens -> text a client may see, with stop strings cut out.

Two small steps, kept apart so each can be tested on hand-built pieces:

- the tokenizer's incremental detokenizer turns ids into text, holding back the bytes
  of a character split across tokens (it never emits half a UTF-8 sequence);
- StopStrings holds back any tail of that text that could still be the start of a
  stop string. A stop string can span several tokens ("\\n\\n" from "\\n" + "\\n"), and
  text that turns out to be a stop string is never sent: once sent, text cannot be
  taken back.

OpenAI's rule: the output ends before the first occurrence of any stop string, and the
stop string itself is not part of it.
"""
from __future__ import annotations

from typing import Iterable, Protocol


def marker_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`
    (0: none): text that may still become a marker, held back until it is decided."""
    best = 0
    for s in markers:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopStrings:
    """Feed text pieces; get back the part that is safe to emit."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]   # unique, non-empty, in order
        self._held = ""
        self.stopped = False     # a stop string was found; nothing more will be emitted
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        """Text that can no longer become (part of) a stop string."""
        if self.stopped:
            return ""
        text = self._held + piece
        # The held text contains no complete stop string (it would have ended the
        # stream), so the earliest match found here is the first in the whole output.
        first = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.stopped, self.matched, self._held = True, first[1], ""
            return text[:first[0]]
        keep = marker_tail(text, self.stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: the held tail was not a stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out


class _Detokenizer(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TextStream:
    """Token ids in, visible text out: incremental detokenization then stop strings."""

    def __init__(self, detokenizer: _Detokenizer, stops: Iterable[str] = ()):
        self._detok = detokenizer
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def feed(self, token_id: int) -> str:
        return self._stops.push(self._detok.feed(token_id))

    def finish(self) -> str:
        """Everything still held back, once generation has ended on its own. The
        detokenizer's unfinished character (shown as U+FFFD) may itself complete a stop
        string, so it goes through the stop check like any other piece."""
        text = self._stops.push(self._detok.flush())
        return text + self._stops.flush()

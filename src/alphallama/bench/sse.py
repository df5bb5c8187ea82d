"""Incremental parser for `text/event-stream` bodies (the subset of the WHATWG rules
that OpenAI-compatible servers use): lines end in LF, CRLF or CR; a blank line ends an
event; `data:` lines join with LF; lines starting with `:` are comments."""
from __future__ import annotations

import re
from dataclasses import dataclass

_EOL = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class Event:
    event: str
    data: str


class SSEDecoder:
    """Feed text as it arrives; get back the events that are complete."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        # A trailing CR may be the first half of a CRLF split across reads: hold it.
        held = self._buf.endswith("\r")
        body = self._buf[:-1] if held else self._buf
        lines = _EOL.split(body)
        self._buf = lines.pop() + ("\r" if held else "")
        events: list[Event] = []
        for line in lines:
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        return events

    def finish(self) -> list[Event]:
        """End of body: a last event without its blank line still counts."""
        events = self.feed("\n") if self._buf else []
        ev = self._line("")
        return events + ([ev] if ev is not None else [])

    def _line(self, line: str) -> Event | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            ev = Event(self._event or "message", "\n".join(self._data))
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        return None

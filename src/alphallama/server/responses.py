"""Response bodies and stream chunks for the two endpoints, in OpenAI's shapes.

`/v1/chat/completions` and `/v1/completions` differ only in how a choice and its
log-probabilities are spelled; each has a Format class with the same methods, picked
by the route. Both add llama-server's `timings` object to the final chunk and to the
whole response: that is the decode counter benchmarks read.
"""
from __future__ import annotations

import time
import uuid
from typing import Protocol

from ..tokenizer import Tokenizer
from .reasoning import Thinking

TokenLogprob = tuple[int, float, list[tuple[int, float]]]   # id, log-prob, top k


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Format(Protocol):
    def opening(self) -> dict | None: ...
    def chunk(self, text: str | None, logprobs: list[TokenLogprob], finish_reason: str | None,
              role: bool = False) -> dict: ...
    def response(self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str,
                 usage: dict, timings: dict) -> dict: ...
    def usage_chunk(self, usage: dict, timings: dict) -> dict: ...


class _Base:
    object_full: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str, tokenizer: Tokenizer, want_logprobs: bool):
        self.id = self.id_prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = model
        self.tok = tokenizer
        self.want_logprobs = want_logprobs

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "alphallama", "choices": choices}

    def _piece(self, tid: int) -> bytes:
        return self.tok.token_to_piece(tid, special=True)

    def usage_chunk(self, usage: dict, timings: dict) -> dict:
        """OpenAI's extra last chunk for stream_options.include_usage: no choices."""
        return {**self._envelope(self.object_chunk, []), "usage": usage, "timings": timings}


class ChatFormat(_Base):
    """thinking: the reasoning splitter of a thinking model's answer (server/reasoning.py, or
    server/harmony.py for gpt-oss's channels)."""
    object_full, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, model: str, tokenizer: Tokenizer, want_logprobs: bool, thinking: Thinking | None = None):
        super().__init__(model, tokenizer, want_logprobs)
        self.thinking = thinking

    def _split(self, text: str | None, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a piece; without a splitter the piece is content as it is."""
        if self.thinking is None:
            return None, text
        r, c = self.thinking.feed(text) if text else ("", "")
        if final:
            r2, c2 = self.thinking.finish()
            r, c = r + r2, c + c2
        return r or None, c or None

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None

        def one(tid: int, lp: float) -> dict:
            b = self._piece(tid)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
        return {"content": [{**one(tid, lp), "top_logprobs": [one(t, v) for t, v in top]}
                            for tid, lp, top in entries]}

    def opening(self) -> dict | None:
        return self.chunk("", [], None, role=True)   # OpenAI's first chunk names the role

    def chunk(self, text, logprobs, finish_reason, role=False):
        if role:
            return self._chunk({"role": "assistant", "content": text}, logprobs, finish_reason)
        reasoning, content = self._split(text, finish_reason is not None)
        return self._content_chunk(reasoning, content, logprobs, finish_reason)

    def _content_chunk(self, reasoning: str | None, content: str | None, logprobs, finish_reason) -> dict:
        delta: dict = {} if reasoning is None else {"reasoning_content": reasoning}
        if content is not None:
            delta["content"] = content
        return self._chunk(delta, logprobs, finish_reason)

    def _chunk(self, delta: dict, logprobs, finish_reason) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])

    def response(self, text, logprobs, finish_reason, usage, timings):
        reasoning, content = self._split(text, final=True)
        if self.thinking is not None:
            content = content or ""
        return self._response(reasoning, content, logprobs, finish_reason, usage, timings)

    def _response(self, reasoning: str | None, content: str | None, logprobs, finish_reason, usage, timings) -> dict:
        message: dict = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(logprobs or []),
                  "finish_reason": finish_reason}
        return {**self._envelope(self.object_full, [choice]), "usage": usage, "timings": timings}


class TextFormat(_Base):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str, tokenizer: Tokenizer, want_logprobs: bool):
        super().__init__(model, tokenizer, want_logprobs)
        self._offset = 0   # characters of completion text before the next token (text_offset)

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in entries:
            text = self._piece(tid).decode("utf-8", errors="replace")
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._piece(t).decode("utf-8", errors="replace"): v for t, v in top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def opening(self) -> dict | None:
        return None

    def chunk(self, text, logprobs, finish_reason, role=False):
        choice = {"index": 0, "text": text or "", "logprobs": self._logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])

    def response(self, text, logprobs, finish_reason, usage, timings):
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs or []),
                  "finish_reason": finish_reason}
        return {**self._envelope(self.object_full, [choice]), "usage": usage, "timings": timings}


FORMATS: dict[str, type[ChatFormat] | type[TextFormat]] = {"chat": ChatFormat, "completions": TextFormat}

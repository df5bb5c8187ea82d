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
    object_full, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

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
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs) if logprobs else None,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])

    def response(self, text, logprobs, finish_reason, usage, timings):
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self._logprobs(logprobs or []), "finish_reason": finish_reason}
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

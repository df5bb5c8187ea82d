"""The one streaming client every arm goes through, and what it measures per request.

Figures (all per request):
  ttft_s       request sent -> first chunk carrying generated text (a role-only
               chunk does not count; reasoning text does).
  client_tps   (tokens - 1) / (last text chunk time - first text chunk time): tokens
               after the first over the time since the first, on our clock.
  server_tps   predicted_n / predicted_ms * 1000 from the server's `timings` object
               (llama-server style, in the final chunks); None when none is sent
               (Ollama, vLLM): then only the client clock is available.
  tokens       usage.completion_tokens, else timings.predicted_n, else text chunks.
  rounds etc.  our server adds `rounds`; tokens/round = predicted_n / rounds and
               ms/round = predicted_ms / rounds (DESIGN §8: tok/s = tokens per round
               / ms per round). draft_n / draft_n_accepted give the acceptance rate.
A request that fails (HTTP error, a stream cut off before `[DONE]`, no data for
`read_timeout` seconds) yields ok=False with the reason; it never raises.
"""
from __future__ import annotations

import codecs
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from .sse import Event, SSEDecoder

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Measurement:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    client_tps: float | None = None
    server_tps: float | None = None
    server_tps_reported: float | None = None   # predicted_per_second as sent
    tokens: int | None = None
    token_source: str | None = None             # usage | timings | chunks
    chunks: int = 0                             # chunks that carried text
    text_chars: int = 0
    prompt_tokens: int | None = None
    prefill_tps: float | None = None
    rounds: int | None = None
    tokens_per_round: float | None = None
    ms_per_round: float | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    acceptance: float | None = None
    finish_reason: str | None = None
    e2e_s: float | None = None
    timings: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


def _num(obj: dict[str, Any] | None, key: str) -> float | None:
    value = (obj or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ratio(num: float | None, den: float | None, scale: float = 1.0) -> float | None:
    return num / den * scale if num is not None and den else None


def apply_timings(m: Measurement, timings: dict[str, Any] | None) -> None:
    """Fill the server-side figures from a llama-server style `timings` object."""
    m.timings = timings
    if not timings:
        return
    n, ms = _num(timings, "predicted_n"), _num(timings, "predicted_ms")
    m.server_tps = _ratio(n, ms, 1000.0) if n and n > 0 else None
    m.server_tps_reported = _num(timings, "predicted_per_second")
    m.prefill_tps = _ratio(_num(timings, "prompt_n"), _num(timings, "prompt_ms"), 1000.0)
    rounds = _num(timings, "rounds")
    if rounds and rounds > 0:
        m.rounds = int(rounds)
        m.tokens_per_round = _ratio(n, rounds)
        m.ms_per_round = _ratio(ms, rounds)
    drafts, accepted = _num(timings, "draft_n"), _num(timings, "draft_n_accepted")
    m.draft_n = int(drafts) if drafts is not None else None
    m.draft_n_accepted = int(accepted) if accepted is not None else None
    m.acceptance = _ratio(accepted, drafts)


class _StreamState:
    """What the events of one response have told us so far."""

    def __init__(self, on_chunk: Callable[[float], None] | None = None) -> None:
        self.on_chunk = on_chunk
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.chunks = 0
        self.chars = 0
        self.done = False
        self.finish_reason: str | None = None
        self.timings: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def on_event(self, ev: Event, now: float) -> None:
        if ev.data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(ev.data)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {ev.data[:200]!r}"
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            self.error = f"server error: {json.dumps(obj['error'])[:300]}"
            return
        text = 0
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            text += sum(len(delta.get(k) or "") for k in ("content", "reasoning_content"))
            text += len(choice.get("text") or "")      # /v1/completions
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if text:
            self.t_first = now if self.t_first is None else self.t_first
            self.t_last = now
            self.chunks += 1
            self.chars += text
            if self.on_chunk is not None:
                self.on_chunk(now)
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]   # the last one sent is the final count
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]


def stream_chat(http: httpx.Client, root: str, body: dict[str, Any],
                clock: Callable[[], float] = time.perf_counter, path: str = CHAT_PATH,
                on_chunk: Callable[[float], None] | None = None) -> Measurement:
    """POST one streaming chat completion (or, with path="/v1/completions", a text
    completion) to `root` and measure it; `on_chunk(t)` hears each text chunk's arrival."""
    m = Measurement()
    state = _StreamState(on_chunk)
    decoder = SSEDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    t0 = clock()
    try:
        with http.stream("POST", root + path, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                m.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return m
            for raw in resp.iter_bytes():
                now = clock()
                for ev in decoder.feed(utf8.decode(raw)):
                    state.on_event(ev, now)
                if state.done or state.error:
                    break
            if not state.done and not state.error:
                for ev in decoder.feed(utf8.decode(b"", final=True)) + decoder.finish():
                    state.on_event(ev, clock())
    except httpx.TimeoutException as e:
        m.error = f"timeout ({type(e).__name__}): no data within the read timeout"
    except httpx.HTTPError as e:
        m.error = f"{type(e).__name__}: {e}"
    m.e2e_s = clock() - t0
    return _finish(m, state, t0)


def _finish(m: Measurement, s: _StreamState, t0: float) -> Measurement:
    m.chunks, m.text_chars, m.finish_reason, m.usage = s.chunks, s.chars, s.finish_reason, s.usage
    apply_timings(m, s.timings)
    if m.error is None and s.error is not None:
        m.error = s.error
    if m.error is None and not (s.done or s.finish_reason):
        m.error = "stream ended before [DONE]"
    if m.error is None and s.t_first is None:
        m.error = "no text generated"
    if s.t_first is not None:
        m.ttft_s = s.t_first - t0
    completion = _num(s.usage, "completion_tokens")
    predicted = _num(s.timings, "predicted_n")
    if completion:
        m.tokens, m.token_source = int(completion), "usage"
    elif predicted:
        m.tokens, m.token_source = int(predicted), "timings"
    elif s.chunks:
        m.tokens, m.token_source = s.chunks, "chunks"
    m.prompt_tokens = int(_num(s.usage, "prompt_tokens") or _num(s.timings, "prompt_n") or 0) or None
    if m.tokens and m.tokens >= 2 and s.t_first is not None and s.t_last > s.t_first:
        m.client_tps = (m.tokens - 1) / (s.t_last - s.t_first)
    m.ok = m.error is None
    return m


def request_body(model: str, messages, max_tokens: int, temperature: float,
                 seed: int | None, include_usage: bool,
                 extra: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    body.update(extra or {})
    return body

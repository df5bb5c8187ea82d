"""POST /completion: llama-server's native completion (not OpenAI's).

The body: `prompt` (a text, or token ids mixed with texts), `n_predict` (-1: until the
end; 0: only evaluate the prompt into the cache), the sampling fields, `stop`, `stream`,
`return_tokens`, `n_probs`. The answer: `content`, `tokens`, `stop`, `stop_type`
(eos | word | limit), `stopping_word`, `timings`, ... With `stream`, each event is
{content, tokens, stop: false, ...} and the last one the whole final object with
`stop: true` (its content and tokens empty: they were streamed); no [DONE], as
llama-server ends its native stream.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from ..engine import ContextOverflow, Engine, GenStats
from ..sampling import SamplingParams
from .calls import GONE, check_text_sizes, mixed_ids, on_engine
from .chat_output import make_constraint, native_grammar
from .errors import APIError
from .llama_routes import params_json
from .llama_schemas import NativeCompletionRequest
from .response_schemas import error_responses, streamed
from .sampling_fields import request_sampling
from .state import AppState, app_state
from .streaming import EventStream, sse, until_disconnect
from .worker import Cancelled, Delta, Done, Failed, GenRequest, Job

router = APIRouter()
ENDPOINT = "completion"


class NativeCompletion(BaseModel):
    model_config = ConfigDict(extra="allow")   # response_fields may pick out any subset
    content: str | None = None
    tokens: list[int] | None = None
    stop: bool | None = None
    stop_type: str | None = None
    timings: dict[str, int | float] | None = None


@router.post("/completion", summary="Completion in llama-server's native shape", response_model=NativeCompletion,
             response_model_exclude_unset=True,
             responses={**streamed("the completion, or with stream: true its events as server-sent events"),
                        **error_responses(400, 401, 413, 429, 500, 503)})
async def completion(body: NativeCompletionRequest, request: Request):
    st = app_state(request)
    try:
        body.check_supported()
        engine = st.ready_engine()
        ids = await run_in_threadpool(_prompt_ids, engine, body.prompt)
        constraint = await run_in_threadpool(make_constraint, engine, native_grammar(body.grammar, body.json_schema),
                                             "grammar" if body.grammar else "json_schema")
        try:
            engine.check_fits(len(ids))
        except ContextOverflow as e:
            raise APIError("context_length", str(e), param="prompt", code="context_length_exceeded") from None
        except ValueError as e:   # an empty prompt
            raise APIError("invalid_request", str(e), param="prompt") from None
        seed = st.settings.sampling.seed if body.seed is None else body.sampling_seed
        sampling = await run_in_threadpool(request_sampling, st.settings.sampling, body, engine, seed)
        limit = body.token_limit if body.token_limit is not None else st.settings.n_predict
        stops = body.stop_list()
        answer = _Answer(st, engine, body, ids, sampling, limit, stops)
        if limit == 0:   # the prompt only: evaluated into the cache, nothing generated
            return await _prompt_only(request, answer)
        gen = GenRequest(ENDPOINT, ids, limit if limit > 0 else engine.ctx_size, sampling, stops,
                         body.n_probs if body.n_probs > 0 else None, constraint=constraint, ignore_eos=body.ignore_eos)
        job = Job(gen, asyncio.get_running_loop())
        st.worker.submit(job)
    except APIError as e:
        st.metrics.request(ENDPOINT, "rejected" if e.status == 429 else f"error_{e.status}")
        raise
    if body.stream:
        return EventStream(_stream(job, answer), on_close=lambda: st.worker.cancel(job))
    result = await until_disconnect(request, _gather(job), on_disconnect=lambda: st.worker.cancel(job))
    if result is None:
        return Response(status_code=204)
    if isinstance(result, Failed):
        raise result.error
    text, tokens, probs, done = result
    return answer.final(text, tokens, probs, done)


def _prompt_ids(engine: Engine, prompt: str | list) -> list[int]:
    check_text_sizes(engine, prompt)
    return mixed_ids(engine, prompt, add_special=True, parse_special=True)   # llama-server parses specials here


class _Answer:
    """The response objects of one request."""

    def __init__(self, st: AppState, engine: Engine, body: NativeCompletionRequest, ids: list[int],
                 sampling: SamplingParams, limit: int, stops: list[str]):
        self.st, self.engine, self.body, self.ids = st, engine, body, ids
        self.settings = params_json(st, sampling, limit, stops, body.stream, body.n_probs)
        self.n_decoded = 0

    def partial(self, ev: Delta) -> dict:
        self.n_decoded += len(ev.tokens)
        out = {"index": 0, "content": ev.text, "tokens": ev.tokens, "stop": False, "id_slot": 0,
               "tokens_predicted": self.n_decoded, "tokens_evaluated": len(self.ids)}
        if ev.logprobs:
            out["completion_probabilities"] = self._probs(ev.logprobs)
        return out

    def final(self, text: str, tokens: list[int], probs: list, done: Done, streamed: bool = False) -> dict:
        n = done.completion_tokens
        stop_type = "word" if done.stop_word is not None else ("eos" if done.finish_reason == "stop" else "limit")
        out = {"index": 0, "content": "" if streamed else text,
               "tokens": [] if streamed or not self.body.return_tokens else tokens,
               "id_slot": 0, "stop": True, "model": self.st.settings.alias,
               "tokens_predicted": n, "tokens_evaluated": len(self.ids),
               "generation_settings": self.settings,
               "prompt": self.engine.tokenizer.decode(self.ids, special=True),
               "has_new_line": "\n" in text, "truncated": len(self.ids) + n >= self.engine.ctx_size,
               "stop_type": stop_type, "stopping_word": done.stop_word or "",
               "tokens_cached": len(self.ids) + n, "timings": llama_timings(done.timings)}
        if not streamed and probs:
            out["completion_probabilities"] = self._probs(probs)
        fields = self.body.response_fields
        return _nested(fields, out) if fields and not streamed else out

    def _probs(self, entries: list) -> list[dict]:
        tok = self.engine.tokenizer

        def one(tid: int, lp: float) -> dict:
            b = tok.token_to_piece(tid, special=True)
            return {"id": tid, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b), "logprob": lp}
        return [{**one(tid, lp), "top_logprobs": [one(t, v) for t, v in top]} for tid, lp, top in entries]


def llama_timings(t: dict) -> dict:
    """The engine's timings with llama-server's per-token figures added."""
    def per(ms: float, n: int) -> float:
        return ms / n if n > 0 else 0.0
    return {**t, "prompt_per_token_ms": per(t["prompt_ms"], t["prompt_n"]),
            "predicted_per_token_ms": per(t["predicted_ms"], t["predicted_n"])}


def _nested(paths: list[str], obj: dict) -> dict:
    """llama-server's json_get_nested_values: each path "a/b" that exists, under its own name."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = obj
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


async def _prompt_only(request: Request, answer: _Answer):
    def run(engine: Engine, cancelled) -> dict | None:
        stats = GenStats()
        if engine.prefill(answer.ids, stats, cancelled) is None:
            return None
        return stats.timings()
    timings = await on_engine(request, ENDPOINT, run)
    if timings is GONE or timings is None:
        return Response(status_code=204)
    final = answer.final("", [], [], Done("length", 0, timings), streamed=answer.body.stream)
    if answer.body.stream:
        async def one() -> AsyncIterator[str]:
            yield sse(final)
        return EventStream(one(), on_close=lambda: None)
    return final


async def _gather(job: Job) -> tuple[str, list[int], list, Done] | Failed | None:
    parts, tokens, probs = [], [], []
    while True:
        ev = await job.next()
        if isinstance(ev, Delta):
            parts.append(ev.text)
            tokens += ev.tokens
            probs += ev.logprobs
        elif isinstance(ev, Done):
            return "".join(parts), tokens, probs, ev
        elif isinstance(ev, Failed):
            return ev
        elif isinstance(ev, Cancelled):
            return None


async def _stream(job: Job, answer: _Answer) -> AsyncIterator[str]:
    text: list[str] = []
    while True:
        ev = await job.next()
        if isinstance(ev, Cancelled):
            return
        if isinstance(ev, Failed):   # headers are sent: the error goes in the stream
            yield sse(ev.error.body())
            return
        if isinstance(ev, Delta):
            if ev.text or ev.tokens:
                text.append(ev.text)
                yield sse(answer.partial(ev))
            continue
        assert isinstance(ev, Done)
        yield sse(answer.final("".join(text), [], [], ev, streamed=True))
        return

"""The OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Both completion endpoints go the same way: check the request, build the prompt ids
(off the event loop: templates and tokenizers can be slow on long inputs), check they
fit the context, queue a Job for the engine's worker, then stream its events as SSE or
gather them into one response. Every client mistake is found before the job is queued.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request, Response
from starlette.concurrency import run_in_threadpool

from ..chat import ChatTemplateError, TemplateBudgetError
from ..engine import ContextOverflow, Engine
from ..grammar import TokenConstraint
from .chat_output import ChatOutput, make_constraint, request_grammar
from .errors import APIError
from .response_schemas import ChatCompletion, Completion, ModelList, error_responses, streamed
from .responses import FORMATS, Format, usage
from .sampling_fields import request_sampling
from .schemas import ChatRequest, CompletionRequest
from .state import app_state
from .streaming import EventStream, sse, until_disconnect
from .worker import Cancelled, Delta, Done, Failed, GenRequest, Job

router = APIRouter()
_COMPLETION_ERRORS = error_responses(400, 401, 413, 429, 500, 503)


@router.post("/chat/completions", summary="Chat completion (OpenAI-compatible)", response_model=ChatCompletion,
             responses={**streamed("the completion, or with stream: true its chunks as server-sent events"),
                        **_COMPLETION_ERRORS})
async def chat_completions(body: ChatRequest, request: Request):
    output = ChatOutput(body, app_state(request).settings.reasoning_format)   # tools, response_format, reasoning
    return await _complete(request, body, "chat", output.prompt_ids, output)


@router.post("/completions", summary="Text completion (OpenAI-compatible)", response_model=Completion,
             responses={**streamed("the completion, or with stream: true its chunks as server-sent events"),
                        **_COMPLETION_ERRORS})
async def completions(body: CompletionRequest, request: Request):
    def prompt(engine: Engine) -> list[int]:
        p = body.prompt
        if isinstance(p, str):
            return engine.encode_prompt(p)
        if p and isinstance(p[0], str):
            return engine.encode_prompt(p[0])
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError("invalid_request", f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="prompt")
        return list(p)
    return await _complete(request, body, "completions", prompt,
                           constraint=lambda engine: make_constraint(engine, *request_grammar(body)))


@router.get("/models", summary="The model this server serves", response_model=ModelList,
            responses=error_responses(401))
async def models(request: Request):
    st = app_state(request)
    engine = st.worker.engine
    meta = None if engine is None else {"n_ctx": engine.ctx_size, "n_vocab": engine.tokenizer.vocab_size,
                                        "arch": engine.cfg.arch, "n_layers": engine.cfg.n_layers}
    return {"object": "list", "data": [{"id": st.settings.alias, "object": "model", "created": int(st.started),
                                        "owned_by": "alphallama", "meta": meta}]}


# -----------------------------------------------------------------------------------------

async def _complete(request: Request, body: ChatRequest | CompletionRequest, endpoint: str,
                    prompt: Callable[[Engine], list[int]], output: ChatOutput | None = None,
                    constraint: Callable[[Engine], TokenConstraint | None] | None = None):
    """constraint: a text completion's grammar, made beside its prompt (a chat's is its output's)."""
    st = app_state(request)
    try:
        body.check_supported()   # `model` is not checked: one model is served whatever the name (llama-server too)
        engine = st.ready_engine()
        try:
            ids = await run_in_threadpool(prompt, engine)
            engine.check_fits(len(ids))
            grammar = await run_in_threadpool(constraint, engine) if constraint is not None else None
        except TemplateBudgetError as e:   # a hostile (or broken) template of the model's
            raise APIError("invalid_request", f"the model's chat template could not render these messages: {e}",
                           param="messages") from None
        except ChatTemplateError as e:
            raise APIError("invalid_request", f"the chat template refused these messages: {e}",
                           param="messages") from None
        except ContextOverflow as e:
            raise APIError("context_length", str(e), param="messages" if endpoint == "chat" else "prompt",
                           code="context_length_exceeded") from None
        except ValueError as e:   # an empty prompt
            raise APIError("invalid_request", str(e)) from None
        sampling = await run_in_threadpool(request_sampling, st.settings.sampling, body, engine,
                                           st.settings.sampling.seed if body.seed is None else body.seed)
        limit = body.token_limit if body.token_limit is not None else st.settings.n_predict
        gen = GenRequest(endpoint, ids, limit if limit > 0 else engine.ctx_size, sampling,
                         body.stop_list(), body.n_logprobs, ignore_eos=body.ignore_eos,
                         **({"constraint": grammar} if output is None else
                            {"constraint": output.constraint, "shown_tokens": output.shown_tokens}))
        job = Job(gen, asyncio.get_running_loop())
        st.worker.submit(job)
    except APIError as e:
        st.metrics.request(endpoint, "rejected" if e.status == 429 else f"error_{e.status}")
        raise
    make_format = FORMATS[endpoint] if output is None else output.format
    fmt = make_format(st.settings.alias, engine.tokenizer, body.n_logprobs is not None)
    if body.stream:
        return EventStream(_stream(job, fmt, len(ids), body.include_usage), on_close=lambda: st.worker.cancel(job))
    result = await until_disconnect(request, _gather(job), on_disconnect=lambda: st.worker.cancel(job))
    if result is None:   # the client is gone; nobody reads this
        return Response(status_code=204)
    if isinstance(result, Failed):   # raised here, outside the task group, to keep its type
        raise result.error
    text, logprobs, done = result
    return fmt.response(text, logprobs if body.n_logprobs is not None else None, done.finish_reason,
                        usage(len(ids), done.completion_tokens), done.timings)


async def _gather(job: Job) -> tuple[str, list, Done] | Failed | None:
    parts, logprobs = [], []
    while True:
        ev = await job.next()
        if isinstance(ev, Delta):
            parts.append(ev.text)
            logprobs += ev.logprobs
        elif isinstance(ev, Done):
            return "".join(parts), logprobs, ev
        elif isinstance(ev, Failed):
            return ev
        elif isinstance(ev, Cancelled):
            return None


async def _stream(job: Job, fmt: Format, n_prompt: int, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's chunk sequence: a role chunk, content chunks, a chunk with finish_reason
    (and llama-server's timings), the usage chunk when asked for, then [DONE]."""
    started = False
    while True:
        ev = await job.next()
        if isinstance(ev, Cancelled):
            return
        if isinstance(ev, Failed):   # headers are sent: the error goes in the stream, as OpenAI does
            yield sse(ev.error.body())
            return
        if not started:
            started = True
            if (first := fmt.opening()) is not None:
                yield sse(first)
        if isinstance(ev, Delta):
            if ev.text or ev.logprobs:
                yield sse(fmt.chunk(ev.text, ev.logprobs, None))
            continue
        assert isinstance(ev, Done)
        final = fmt.chunk(None, [], ev.finish_reason)
        u = usage(n_prompt, ev.completion_tokens)
        final["timings"] = ev.timings
        if include_usage:
            final["usage"] = None
            yield sse(final)
            yield sse(fmt.usage_chunk(u, ev.timings))
        else:
            yield sse(final)
        yield sse("[DONE]")
        return

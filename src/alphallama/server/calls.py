"""Running a function on the engine in its turn, from a route: queue an EngineCall
behind the generations already waiting, await its Result, cancel it if the client goes.

Also the prompt shapes llama-server's native endpoints take (text, or token ids mixed
with texts) turned into ids, checked against the vocabulary.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import Request

from ..engine import Engine
from .errors import APIError
from .state import app_state
from .streaming import until_disconnect
from .worker import Cancelled, EngineCall, Failed, Job, Result

GONE = object()   # the client disconnected before the answer


async def on_engine(request: Request, endpoint: str, fn: Callable[[Engine, Callable[[], bool]], Any]) -> Any:
    """fn(engine, cancelled)'s value, computed in the worker thread; GONE if the client left.
    A failure inside fn is raised here as the worker's APIError (a 500)."""
    st = app_state(request)
    job = Job(EngineCall(endpoint, fn), asyncio.get_running_loop())
    try:
        st.worker.submit(job)
    except APIError as e:
        st.metrics.request(endpoint, "rejected" if e.status == 429 else f"error_{e.status}")
        raise
    ev = await until_disconnect(request, job.next(), on_disconnect=lambda: st.worker.cancel(job))
    if ev is None or isinstance(ev, Cancelled):
        return GONE
    if isinstance(ev, Failed):
        raise ev.error
    assert isinstance(ev, Result)
    return ev.value


def mixed_ids(engine: Engine, prompt: str | list, add_special: bool, parse_special: bool,
              param: str = "prompt") -> list[int]:
    """llama-server's tokenize_mixed: a text, or a list of token ids and texts; only a text
    in the first place gets the BOS (with add_special). Ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt, add_special=add_special, parse_special=parse_special)
    ids: list[int] = []
    vocab = engine.tokenizer.vocab_size
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids += engine.tokenizer.encode(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif 0 <= part < vocab:
            ids.append(part)
        else:
            raise APIError("invalid_request", f"token id {part} is outside the vocabulary (0..{vocab - 1})",
                           param=f"{param}[{i}]")
    return ids


def check_text_sizes(engine: Engine, prompt: str | list, param: str = "prompt") -> None:
    """Refuse a text too long for the context before tokenizing it (Engine.check_text_fits)."""
    from ..engine import ContextOverflow
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    try:
        engine.check_text_fits("".join(texts))
    except ContextOverflow as e:
        raise APIError("context_length", str(e), param=param, code="context_length_exceeded") from None

"""llama-server's own endpoints, in its shapes (tools/server/README.md and server-*.cpp):
GET /props, GET /slots, POST /tokenize, /detokenize, /apply-template. /completion is
in native_completion.py, the embeddings in embeddings.py.

/props and /slots carry llama-server's fields that mean something here (one slot, the
server's sampling defaults); /props adds an `alphallama` object with the device and
the speculation mode, which the web page shows.
"""
from __future__ import annotations

import math
from typing import Any, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..chat import ChatTemplate, ChatTemplateError, TemplateBudgetError, chat_prompt_text
from ..engine import Engine
from ..sampling import SamplingParams
from .calls import check_text_sizes, mixed_ids
from .errors import APIError
from .llama_schemas import DetokenizeRequest, TokenizeRequest
from .response_schemas import error_responses
from .schemas import ChatRequest
from .state import AppState, app_state
from .worker import GenRequest, Job

router = APIRouter()
RANDOM_SEED = 4294967295   # llama.cpp's LLAMA_DEFAULT_SEED: "a random seed"


def params_json(st: AppState, sampling: SamplingParams, n_predict: int, stops: list[str], stream: bool,
                n_probs: int) -> dict:
    """llama-server's task_params.to_json: the settings a request runs with (those that exist here)."""
    spec = st.settings.spec
    return {"seed": RANDOM_SEED if sampling.seed is None else sampling.seed, "temperature": sampling.temperature,
            "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
            "n_predict": n_predict, "max_tokens": n_predict, "stop": stops, "stream": stream,
            "repeat_last_n": sampling.repeat_last_n, "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "logit_bias": [{"token": t, "bias": b if b > -math.inf else False}   # false: never (JSON has no -inf)
                           for t, b in sampling.logit_bias],
            "n_probs": n_probs, "ignore_eos": False,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "speculative.types": spec.spec_type, "speculative.n_max": spec.draft_max,
            "timings_per_token": False, "post_sampling_probs": False, "lora": []}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class GenerationSettings(_Open):
    n_ctx: int
    params: dict[str, Any]


class Props(_Open):
    default_generation_settings: GenerationSettings
    total_slots: int
    model_alias: str
    model_path: str
    chat_template: str
    bos_token: str
    eos_token: str
    build_info: str
    is_sleeping: bool
    alphallama: dict[str, Any]


class Slot(_Open):
    id: int
    n_ctx: int
    speculative: bool
    is_processing: bool


class TokenPiece(BaseModel):
    id: int
    piece: Union[str, list[int]]   # the text, or its bytes when they are not valid UTF-8


class Tokens(BaseModel):
    tokens: Union[list[int], list[TokenPiece]]


class Detokenized(BaseModel):
    content: str


class AppliedTemplate(BaseModel):
    prompt: str


def _spec_type(st: AppState, engine: Engine) -> str:
    return st.settings.spec.on_device(engine.cache.k.device.type).spec_type


@router.get("/props", summary="Server properties (llama-server's shape)", response_model=Props,
            responses=error_responses(401, 503))
async def props(request: Request):
    st = app_state(request)
    engine = st.ready_engine()
    s = st.settings
    tmpl = engine.chat_template or ChatTemplate.from_gguf_metadata(engine.gguf.metadata)
    c = engine.cfg
    return {
        "default_generation_settings": {"n_ctx": engine.ctx_size,
                                        "params": params_json(st, s.sampling, s.n_predict, [], False, 0)},
        "total_slots": len(engine.slots), "model_alias": s.alias, "model_path": engine.gguf.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": tmpl.source, "chat_template_caps": {},
        "bos_token": tmpl.bos_token, "eos_token": tmpl.eos_token,
        "build_info": f"alphallama {__version__}", "is_sleeping": False,
        "alphallama": {"device": engine.cache.k.device.type, "speculation": _spec_type(st, engine),
                       "mode": s.spec.mode, "arch": c.arch, "n_layers": c.n_layers, "d_model": c.d_model,
                       "n_vocab": engine.tokenizer.vocab_size, "pooling": s.pooling},
    }


@router.get("/slots", summary="The slots' state (llama-server's shape; -np N slots)",
            response_model=list[Slot], responses=error_responses(401, 503))
async def slots(request: Request, fail_on_no_slot: str | None = None):
    st = app_state(request)
    engine = st.ready_engine()
    w = st.worker
    one = len(engine.slots) == 1
    out = []
    for s in engine.slots:
        job = (w.last_job if one else w.slot_jobs.get(s.id))
        busy = w.processing > 0 if one else (job is not None and job in w.running)
        slot: dict[str, Any] = {"id": s.id, "n_ctx": engine.ctx_size,
                                "speculative": _spec_type(st, engine) != "none", "is_processing": busy}
        if job is not None:
            slot.update(_job_json(st, engine, job))
        out.append(slot)
    if fail_on_no_slot and all(s["is_processing"] for s in out):
        raise APIError("unavailable", "no slot available")
    return out


def _job_json(st: AppState, engine: Engine, job: Job) -> dict:
    out: dict[str, Any] = {"id_task": job.id}
    r = job.request
    if isinstance(r, GenRequest):
        out["n_prompt_tokens"] = len(r.prompt_ids)
        out["params"] = params_json(st, r.sampling, r.max_tokens, list(r.stops), False, r.n_logprobs or 0)
        out["next_token"] = [{"has_next_token": not job.finished, "n_remain": max(r.max_tokens - job.n_decoded, 0),
                              "n_decoded": job.n_decoded}]
    return out


@router.post("/tokenize", summary="Text -> token ids (llama-server's shape)", response_model=Tokens,
             responses=error_responses(400, 401, 413, 503))
async def tokenize(body: TokenizeRequest, request: Request):
    engine = app_state(request).ready_engine()

    def run() -> dict:
        check_text_sizes(engine, body.content, "content")
        ids = mixed_ids(engine, body.content, body.add_special, body.parse_special, param="content")
        if not body.with_pieces:
            return {"tokens": ids}
        out = []
        for tid in ids:
            piece = engine.tokenizer.token_to_piece(tid, special=True)
            try:
                out.append({"id": tid, "piece": piece.decode("utf-8")})
            except UnicodeDecodeError:   # part of a character: its bytes
                out.append({"id": tid, "piece": list(piece)})
        return {"tokens": out}
    return await run_in_threadpool(run)


@router.post("/detokenize", summary="Token ids -> text (llama-server's shape)", response_model=Detokenized,
             responses=error_responses(400, 401, 413, 503))
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = app_state(request).ready_engine()
    vocab = engine.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError("invalid_request", f"token id {body.tokens[bad]} is outside the vocabulary (0..{vocab - 1})",
                       param=f"tokens[{bad}]")
    # llama-server joins the pieces as they are (special tokens as their text)
    return {"content": engine.tokenizer.decode(body.tokens, special=True, continuation=True)}


@router.post("/apply-template", summary="Chat messages -> the prompt text the model's template makes",
             response_model=AppliedTemplate, responses=error_responses(400, 401, 413, 503))
async def apply_template(body: ChatRequest, request: Request):   # llama-server parses the chat body
    body.check_supported()     # the body's rules as its schema states them (n, top_logprobs)
    engine = app_state(request).ready_engine()
    tmpl = engine.chat_template or ChatTemplate.from_gguf_metadata(engine.gguf.metadata)
    try:
        text = await run_in_threadpool(chat_prompt_text, tmpl, engine.tokenizer, body.conversation())
    except TemplateBudgetError as e:
        raise APIError("invalid_request", f"the model's chat template could not render these messages: {e}",
                       param="messages") from None
    except ChatTemplateError as e:
        raise APIError("invalid_request", f"the chat template refused these messages: {e}", param="messages") from None
    return {"prompt": text}

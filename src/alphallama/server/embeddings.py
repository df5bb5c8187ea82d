"""Embeddings: POST /v1/embeddings (OpenAI's shape) and llama-server's /embeddings and
/embedding (its own shape), as llama-server computes them with `--embeddings`.

An input's embedding is the model's final hidden state (after the output norm) pooled
over its tokens (mean by default; `--pooling cls|last`), then normalized
(`embd_normalize`, Euclidean by default), as llama.cpp's common_embd_normalize does.
The forward pass runs in the engine's turn (it overwrites the cached conversation, which
the next request re-uses as far as it matches).
"""
from __future__ import annotations

import base64
from typing import Callable, Literal, Union

import torch
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ..engine import Engine
from .calls import GONE, check_text_sizes, mixed_ids, on_engine
from .errors import APIError
from .llama_schemas import EmbeddingsRequest
from .response_schemas import error_responses
from .state import app_state

router = APIRouter()

# The pooling over a sequence's final hidden states [T, D] -> [D].
POOLINGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "mean": lambda h: h.mean(0),
    "cls": lambda h: h[0],
    "last": lambda h: h[-1],
}


def normalize(v: torch.Tensor, p: int) -> torch.Tensor:
    """llama.cpp's common_embd_normalize: -1 none, 0 max-abs scaled to the int16 range,
    2 Euclidean, any other p the p-norm (1: taxicab). The sum in float64; [D] float32."""
    x = v.double()
    if p == -1:
        s = 1.0
    elif p == 0:
        s = float(x.abs().max()) / 32760.0
    elif p == 2:
        s = float(x.pow(2).sum().sqrt())
    else:
        s = float(x.abs().pow(p).sum() ** (1.0 / p))
    return (v.float() * (1.0 / s if s > 0 else 0.0)).float()


class EmbeddingItem(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]    # floats, or base64 of little-endian float32 with encoding_format


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    model: str
    data: list[EmbeddingItem]
    usage: EmbeddingUsage


class NativeEmbedding(BaseModel):
    index: int
    embedding: list[list[float]]          # one row: the pooled vector


_ERRORS = error_responses(400, 401, 413, 429, 500, 503)


@router.post("/v1/embeddings", summary="Embeddings (OpenAI-compatible): the pooled final hidden state",
             response_model=EmbeddingList, responses=_ERRORS)
async def embeddings_oai(body: EmbeddingsRequest, request: Request):
    out = await _embed(request, body)
    if out is None:
        return Response(status_code=204)
    vectors, counts = out
    st = app_state(request)

    def encode(v: torch.Tensor) -> list[float] | str:
        if body.encoding_format == "base64":
            return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        return v.tolist()
    n = sum(counts)
    return {"model": body.model or st.settings.alias, "object": "list",
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [{"embedding": encode(v), "index": i, "object": "embedding"} for i, v in enumerate(vectors)]}


@router.post("/embeddings", summary="Embeddings in llama-server's own shape", response_model=list[NativeEmbedding],
             responses=_ERRORS)
async def embeddings_native(body: EmbeddingsRequest, request: Request):
    out = await _embed(request, body)
    if out is None:
        return Response(status_code=204)
    return [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(out[0])]


# llama-server's legacy name
router.add_api_route("/embedding", embeddings_native, methods=["POST"], include_in_schema=False)


async def _embed(request: Request, body: EmbeddingsRequest) -> tuple[list[torch.Tensor], list[int]] | None:
    """Each input's embedding [D] and token count; None if the client left."""
    st = app_state(request)
    try:
        body.check_supported()
        items = body.inputs()
        engine = st.ready_engine()
        if body.dimensions is not None and body.dimensions != engine.cfg.d_model:
            raise APIError("invalid_request", f"this model's embeddings have {engine.cfg.d_model} dimensions; "
                           f"{body.dimensions} were asked for", param="dimensions")
        ids = await run_in_threadpool(_tokenize, engine, items)
    except APIError as e:
        st.metrics.request("embeddings", f"error_{e.status}")
        raise
    pool = POOLINGS[st.settings.pooling]

    def compute(engine: Engine, cancelled: Callable[[], bool]) -> list[torch.Tensor] | None:
        out = []
        for one in ids:
            h = engine.final_hidden(one, cancelled)                     # [T, D]
            if h is None:
                return None
            out.append(normalize(pool(h), body.embd_normalize))
        return out
    vectors = await on_engine(request, "embeddings", compute)
    if vectors is GONE or vectors is None:
        return None
    return vectors, [len(one) for one in ids]


def _tokenize(engine: Engine, items: list[str | list]) -> list[list[int]]:
    """Each input's ids, as llama-server tokenizes them (BOS as the model asks, special-token
    texts parsed); an empty or too long input is refused."""
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]" if len(items) > 1 else "input"
        check_text_sizes(engine, item, where)
        one = mixed_ids(engine, item, add_special=True, parse_special=True, param=where)
        if not one:
            raise APIError("invalid_request", "input content cannot be empty", param=where)
        if len(one) > engine.ctx_size:
            raise APIError("context_length", f"the input has {len(one)} tokens but the context holds "
                           f"{engine.ctx_size}", param=where, code="context_length_exceeded")
        out.append(one)
    return out

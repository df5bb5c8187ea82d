"""The response bodies, as pydantic models: the routes' `response_model`s, so the OpenAPI
schema says what the server really sends and a schema-driven client or fuzzer can check
it. The shapes are OpenAI's (responses.py builds them) plus llama-server's `timings`.
Every error, whatever its status, has the one ErrorBody shape (errors.py)."""
from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

Timings = dict[str, int | float]   # llama-server's counters: prompt_n, predicted_per_second, ...


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunction(BaseModel):
    name: str
    arguments: str            # JSON text of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None       # null when the answer is tool calls alone
    reasoning_content: str | None = None   # a thinking model's <think> text (server/reasoning.py)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class _Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class TextLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: str


class Completion(_Envelope):
    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage
    timings: Timings


class ModelMeta(BaseModel):
    n_ctx: int
    n_vocab: int
    arch: str
    n_layers: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    meta: ModelMeta | None   # null while the model loads


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


_ERRORS = {400: "invalid request (malformed JSON, a bad field, a prompt too long for the context, "
                "a chat template that refused the messages)",
           401: "missing or wrong API key", 413: "request body too large",
           429: "the queue is full (Retry-After says when to retry)", 503: "the model is not loaded yet",
           500: "a bug of the server's"}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """FastAPI `responses=` entries: these statuses, each with the ErrorBody schema."""
    return {s: {"model": ErrorBody, "description": _ERRORS[s]} for s in statuses}


# One server-sent event, as SSE readers (and schemathesis) parse it: its data is a JSON chunk,
# or `[DONE]` last on the OpenAI routes.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


def streamed(description: str) -> dict[int | str, dict]:
    """A 200 that is JSON, or with "stream": true an SSE stream of chunks (the schema is an event's)."""
    return {200: {"description": description, "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


_ERROR_REF = "#/components/schemas/ErrorBody"


def install_openapi(app: FastAPI) -> None:
    """/openapi.json as the server behaves: FastAPI documents its 422 for every route with
    a body, but errors.py answers validation errors 400 in the ErrorBody shape, and the
    routes list that 400 themselves; the 422 and its schemas go. And FastAPI files every
    documented response under the route's media type; an error is always JSON."""
    def schema() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    responses.pop("422", None)
                    for status, r in responses.items():   # errors are JSON even where the route's
                        if int(status) >= 400:            # own answer is text (/metrics)
                            r["content"] = {"application/json": {"schema": {"$ref": _ERROR_REF}}}
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema
    app.openapi = schema

"""Request bodies of the OpenAI endpoints, validated by pydantic (they also make the
OpenAPI schema).

Validation is strict (a string where a number belongs is an error, not a guess), and
fields this server does not know are ignored, as clients send many (`user`, `metadata`,
`store`, `service_tier`, llama-server's samplers that do not exist here: `typical_p`,
`mirostat*`, `dry_*`, `xtc_*`, `dynatemp_*`, `top_n_sigma`). Fields it knows but cannot
honour are refused with a clear message in `check_supported`, never silently dropped when
they would change the output. The penalties and logit_bias (PenaltyFields) are honoured
(penalties.py).
"""
from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from ..config import DEFAULTS
from ..sampling import MAX_REPEAT_PENALTY, MIN_REPEAT_PENALTY
from .errors import APIError

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
MAX_TOP_LOGPROBS = 20
_SURROGATE = re.compile("[\ud800-\udfff]")


def _scrub(text: str) -> str:
    # JSON may carry a lone surrogate ("\ud800", half an emoji cut by a client). It is no
    # character, the tokenizer cannot take it, and it could not be encoded back: U+FFFD.
    return _SURROGATE.sub("\ufffd", text)


def _stop_text(text: str) -> str:
    # Checked here, not with Field(max_length): pydantic's constrained str rejects the
    # surrogates before _scrub could replace them.
    limit = DEFAULTS.server.max_stop_chars
    if len(text) > limit:
        raise ValueError(f"a stop string may have at most {limit} characters, this one has {len(text)}")
    return _scrub(text)


Text = Annotated[str, AfterValidator(_scrub)]
StopText = Annotated[str, AfterValidator(_stop_text)]
# The rules below are checked by the server itself, with its own message (check_supported,
# stop_list); `json_schema_extra` states them in the OpenAPI schema too, without validating,
# so a schema-driven client or fuzzer knows what is refused.
STOP_COUNT = {"maxItems": DEFAULTS.server.max_stop_strings}


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A body's `stop` as a list; more than the server's limit is a 400 (every completion route)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    limit = DEFAULTS.server.max_stop_strings
    if len(stops) > limit:
        raise APIError("invalid_request", f"at most {limit} stop strings are allowed, got {len(stops)}", param="stop")
    return stops


class _Body(BaseModel):
    model_config = _STRICT


class ContentPart(_Body):
    """A content part: {"type": "text", "text": ...} is understood, others are refused
    (in ChatMessage.text) with a message saying so; the schema states the one it takes."""
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]})
    type: str


class CalledFunction(_Body):
    name: Text
    arguments: Text                      # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    """A call in an assistant message of the history."""
    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None     # assistant messages
    tool_call_id: Text | None = None                    # tool messages

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or not isinstance(getattr(part, "text", None), str):
                raise APIError("invalid_request", f"content parts of type {part.type!r} are not supported "
                               "(this model reads text only)", param=f"messages[{index}].content")
            out.append(_scrub(part.text))
        return "".join(out)


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaSpec(_Body):
    name: Text | None = None
    description: Text | None = None
    schema_: Union[dict, bool, None] = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """text, json_object (any object; llama-server's `schema` beside it narrows it) or
    json_schema (OpenAI's {"json_schema": {"name", "schema", "strict"}})."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: Union[dict, None] = Field(None, alias="schema")


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None       # a JSON schema; none: no arguments
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


def _bias_pairs(value: Union[dict, list, None]) -> tuple[tuple[Union[int, str], float], ...] | None:
    """logit_bias as {key: bias} (OpenAI) or [[key, bias], ...] (llama-server) -> ((key, bias), ...):
    a key is a token id (an integer, or a string of one) or a text; a bias a number in
    [-100, 100] (OpenAI's range) or false: -inf, never (llama-server's)."""
    if value is None:
        return None
    if isinstance(value, dict):
        entries = list(value.items())
    else:
        entries = [tuple(e) if isinstance(e, list) and len(e) == 2 else None for e in value]
        if None in entries:
            raise ValueError("each entry of a logit_bias list must be a [token id or text, bias] pair")
    out = []
    for key, bias in entries:
        if not isinstance(key, (int, str)) or isinstance(key, bool):
            raise ValueError(f"a logit_bias key must be a token id or a text, got {key!r}")
        if bias is False:
            out.append((key, -math.inf))
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100:
            out.append((key, float(bias)))
        else:
            raise ValueError(f"the bias of {key!r} must be a number in [-100, 100] (or false: never), got {bias!r}")
    return tuple(out)


_BIAS = {"anyOf": [{"type": "number", "minimum": -100, "maximum": 100}, {"const": False}]}
LOGIT_BIAS = {"anyOf": [   # what _bias_pairs takes
    {"type": "object", "additionalProperties": _BIAS},
    {"type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                "prefixItems": [{"anyOf": [{"type": "integer"}, {"type": "string"}]}, _BIAS]}},
    {"type": "null"}]}


class PenaltyFields(_Body):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias, llama-server's
    repeat_penalty and repeat_last_n (every completion route; penalties.py has the math).
    None: the server's default (its flags; off unless set)."""
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(None, ge=MIN_REPEAT_PENALTY, le=MAX_REPEAT_PENALTY)   # 1: off
    repeat_last_n: int | None = Field(None, ge=-1)         # 0: no penalties, -1: the whole context
    # {"token id": bias} (OpenAI), or llama-server's [[token id or text, bias], ...]; a text key
    # stands for its tokens (llama-server's); ids outside the vocabulary are a 400 (sampling_fields.py)
    logit_bias: Annotated[Union[dict[str, Any], list[Any], None], AfterValidator(_bias_pairs),
                          WithJsonSchema(LOGIT_BIAS)] = None


class _Common(PenaltyFields):
    """Parameters shared by both endpoints."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)   # what torch's generator takes
    stop: Union[StopText, list[StopText], None] = Field(None, json_schema_extra=STOP_COUNT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, json_schema_extra={"maximum": 1})
    ignore_eos: bool = False     # llama-server's extension: end-of-generation tokens do not end the answer

    def stop_list(self) -> list[str]:
        return stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        self.stop_list()   # refuses too many
        if self.n != 1:
            raise APIError("invalid_request", f"n={self.n} is not supported: this server generates one "
                           "choice per request (n must be 1)", param="n")


class ChatRequest(_Common):
    model_config = ConfigDict(json_schema_extra={"allOf": [   # checked in check_supported, ChatOutput
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},   # needs logprobs
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["none", None]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}]})   # needs tools
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    grammar: Text | None = None          # llama-server's: GBNF
    json_schema: dict | None = None      # llama-server's: a schema without response_format
    chat_template_kwargs: dict | None = None   # llama-server's: the template's variables (enable_thinking)
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None   # llama-server's; default --reasoning-format

    def check_supported(self) -> None:   # tools and response_format: server/chat_output.py
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("invalid_request", "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def token_limit(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        """The messages as the chat template takes them (plain dicts, text content)."""
        out = []
        for i, m in enumerate(self.messages):
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:   # templates take the arguments as an object (HF's convention)
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


def _arguments(text: str):
    """A call's JSON arguments as an object; text that is no JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class CompletionRequest(_Common):
    prompt: Union[Text, list[Text], list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(False, json_schema_extra={"const": False})
    best_of: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    response_format: ResponseFormat | None = None   # as vLLM's completions take it
    grammar: Text | None = None          # llama-server's: GBNF
    json_schema: dict | None = None      # llama-server's

    def check_supported(self) -> None:
        self.check_common()
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError("invalid_request", f"{len(self.prompt)} prompts were sent; this server "
                               "completes one prompt per request", param="prompt")
        if self.best_of not in (None, 1):
            raise APIError("invalid_request", "best_of > 1 is not supported", param="best_of")
        if self.echo:
            raise APIError("invalid_request", "echo is not supported", param="echo")
        if self.suffix:
            raise APIError("invalid_request", "suffix (fill-in-the-middle) is not supported yet",
                           param="suffix")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

"""Request bodies of llama-server's own endpoints (/completion, /tokenize, /detokenize,
the embeddings), as its README and tools/server/*.cpp define them (/apply-template takes
the chat body, schemas.ChatRequest).

The same rules as schemas.py: strict types, unknown fields ignored (clients send many of
llama-server's sampler knobs), and the fields we know but cannot honour refused with a
message in `check_supported`, never silently dropped when they would change the output.
"""
from __future__ import annotations

from typing import Annotated, Union

from pydantic import ConfigDict, Field

from ..config import DEFAULTS
from .errors import APIError
from .schemas import MAX_TOP_LOGPROBS, STOP_COUNT, PenaltyFields, StopText, Text, _Body, stop_strings

# A prompt as llama-server's tokenize_mixed takes it: text, or token ids mixed with texts.
MixedPrompt = Union[Text, list[Union[int, Text]]]


class TokenizeRequest(_Body):
    content: MixedPrompt = ""
    add_special: bool = False          # llama-server's defaults: no BOS,
    parse_special: bool = True         # special-token texts become the tokens
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(default_factory=list)


class NativeCompletionRequest(PenaltyFields):
    """POST /completion: llama-server's native body (the penalties and logit_bias: PenaltyFields)."""
    model_config = ConfigDict(json_schema_extra={   # grammar or json_schema, not both
        "not": {"required": ["grammar", "json_schema"],
                "properties": {"grammar": {"type": "string", "minLength": 1}, "json_schema": {"type": "object"}}}})
    prompt: MixedPrompt
    n_predict: int | None = Field(None, ge=-1)    # -1: until EOS or a full context; 0: only evaluate the prompt
    max_tokens: int | None = Field(None, ge=-1)   # llama-server reads it when n_predict is absent
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, lt=2**64)   # -1: a random seed, as llama-server
    stop: Union[StopText, list[StopText], None] = Field(None, json_schema_extra=STOP_COUNT)
    stream: bool = False
    return_tokens: bool = False
    n_probs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    cache_prompt: bool = True          # the prefix is always re-used here
    id_slot: int = Field(-1, json_schema_extra={"minimum": -1, "maximum": 0})   # one slot (checked below)
    ignore_eos: bool = False
    grammar: str | None = None
    json_schema: dict | None = None
    n_cmpl: int = Field(1, ge=1, json_schema_extra={"maximum": 1})
    response_fields: list[str] | None = None

    def check_supported(self) -> None:
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(p, str) for p in self.prompt) \
                and len(self.prompt) > 1:
            raise APIError("invalid_request", f"{len(self.prompt)} prompts were sent; this server completes "
                           "one prompt per request", param="prompt")
        if self.id_slot not in (-1, 0):
            raise APIError("invalid_request", f"id_slot {self.id_slot} does not exist: this server has one "
                           "slot, 0", param="id_slot")
        if self.grammar and self.json_schema is not None:
            raise APIError("invalid_request", "send grammar or json_schema, not both", param="grammar")
        if self.n_cmpl != 1:
            raise APIError("invalid_request", f"n_cmpl={self.n_cmpl}: this server generates one completion "
                           "per request", param="n_cmpl")

    def stop_list(self) -> list[str]:
        return stop_strings(self.stop)

    @property
    def token_limit(self) -> int | None:
        return self.n_predict if self.n_predict is not None else self.max_tokens

    @property
    def sampling_seed(self) -> int | None:
        return None if self.seed == -1 else self.seed


# An embeddings input: one text, one token list, or a list of either.
# The schema states what inputs() refuses: an empty one, more than the limit in a list.
_OneText = Annotated[Text, Field(json_schema_extra={"minLength": 1})]
_OneIds = Annotated[list[int], Field(json_schema_extra={"minItems": 1})]
EmbeddingInput = Union[_OneText, _OneIds, Annotated[list[Union[_OneText, _OneIds]], Field(json_schema_extra={
    "minItems": 1, "maxItems": DEFAULTS.server.max_embedding_inputs})]]


class EmbeddingsRequest(_Body):
    """POST /v1/embeddings (OpenAI's body, plus llama-server's embd_normalize), and
    /embeddings, /embedding (llama-server's `content` instead of `input`)."""
    model_config = ConfigDict(json_schema_extra={"anyOf": [   # one of them, not null (inputs())
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in ("input", "content")]})
    input: EmbeddingInput | None = None
    content: EmbeddingInput | None = None
    model: str | None = None
    encoding_format: str = Field("float", json_schema_extra={"enum": ["float", "base64"]})
    dimensions: int | None = Field(None, ge=1)
    embd_normalize: int = Field(2, ge=-1)   # -1 none, 0 max-abs (int16 range), 1 taxicab, 2 Euclidean, p > 2

    def inputs(self) -> list[str | list[int]]:
        """Each input to embed, in order: a text or a token-id list."""
        value = self.input if self.input is not None else self.content
        if value is None:
            raise APIError("invalid_request", '"input" (or llama-server\'s "content") must be provided',
                           param="input")
        if isinstance(value, str) or (value and all(isinstance(v, int) for v in value)):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise APIError("invalid_request", '"input" must not be empty', param="input")
        limit = DEFAULTS.server.max_embedding_inputs
        if len(items) > limit:
            raise APIError("invalid_request", f"at most {limit} inputs are embedded per request, got {len(items)}",
                           param="input")
        return items

    def check_supported(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise APIError("invalid_request", f"encoding_format must be 'float' or 'base64', got "
                           f"{self.encoding_format!r}", param="encoding_format")

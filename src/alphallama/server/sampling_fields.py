"""A request's sampling fields -> the SamplingParams it runs with (every completion route).

A field the request leaves out takes the server's default (its flags). logit_bias is
resolved against the vocabulary here: a key that is an integer is a token id and must be
in the vocabulary (a 400 otherwise, where llama-server silently drops it); any other key is
a text whose tokens all get the bias (llama-server's), as is a text in its
[[text, bias], ...] form; `false` is -inf (never: schemas._bias_pairs). One id named twice
gets both biases.
"""
from __future__ import annotations

import re

from ..config import DEFAULTS
from ..engine import Engine
from ..sampling import SamplingParams
from .errors import APIError

_ID = re.compile(r"[+-]?[0-9]+")


def request_sampling(defaults: SamplingParams, body, engine: Engine, seed: int | None) -> SamplingParams:
    """body: a request with temperature, top_k, top_p, min_p and schemas.PenaltyFields; seed: the
    request's seed as the route reads it. Raises APIError (400) for values out of range."""
    def pick(value, default):
        return default if value is None else value
    bias = defaults.logit_bias if body.logit_bias is None else resolve_logit_bias(body.logit_bias, engine)
    params = SamplingParams(temperature=pick(body.temperature, defaults.temperature),
                            top_k=pick(body.top_k, defaults.top_k), top_p=pick(body.top_p, defaults.top_p),
                            min_p=pick(body.min_p, defaults.min_p), seed=seed,
                            repeat_penalty=pick(body.repeat_penalty, defaults.repeat_penalty),
                            repeat_last_n=pick(body.repeat_last_n, defaults.repeat_last_n),
                            presence_penalty=pick(body.presence_penalty, defaults.presence_penalty),
                            frequency_penalty=pick(body.frequency_penalty, defaults.frequency_penalty),
                            logit_bias=bias)
    try:
        params.validate(n_vocab(engine))
    except ValueError as e:
        raise APIError("invalid_request", str(e)) from None
    return params


def n_vocab(engine: Engine) -> int:
    """Token ids a request may name: the tokenizer's, within the logits' width."""
    return min(engine.tokenizer.vocab_size, engine.cfg.vocab_size)


def resolve_logit_bias(pairs: tuple[tuple[int | str, float], ...], engine: Engine) -> tuple[tuple[int, float], ...]:
    """A request's logit_bias as schemas._bias_pairs gives it, ((key, bias), ...) -> ((token id, bias), ...)."""
    return tuple((tid, bias) for key, bias in pairs for tid in _token_ids(key, engine))


def _token_ids(key: int | str, engine: Engine) -> list[int]:
    """A logit_bias key -> the ids it names: an integer (in a string or not) is one id, checked
    against the vocabulary; other text its tokens."""
    if isinstance(key, str) and _ID.fullmatch(key) is None:
        limit = DEFAULTS.server.max_stop_chars
        if len(key) > limit:
            raise APIError("invalid_request", f"logit_bias: a text key may have at most {limit} characters, "
                           f"this one has {len(key)}", param="logit_bias")
        return engine.tokenizer.encode(key, add_special=False, parse_special=False)
    tid, n = int(key), n_vocab(engine)
    if not 0 <= tid < n:
        raise APIError("invalid_request", f"logit_bias: token id {tid} is outside the vocabulary (0..{n - 1})",
                       param="logit_bias")
    return [tid]

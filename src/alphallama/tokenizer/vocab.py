"""The vocabulary as the GGUF file gives it, after llama.cpp's checks: token types,
special-token ids, and the tokens that end generation."""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from alphallama.gguf.reader import GGUFError

log = logging.getLogger(__name__)


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens matched as whole pieces in the text before the model sees it. Without
# parse_special only user-defined ones are (llama.cpp follows HF tokenizers there):
# "<|im_start|>" typed by a user stays text, a user-defined "<tool_call>" does not.
SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)


# End-of-generation tokens. llama.cpp finds them by their text (metadata rarely lists
# them all) and forces them to control type, so they are never rendered as text.

_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
# role -> (metadata key, texts that identify the token when the key is absent). The EOT
# and EOM ids end generation; so do the FIM pad/repo/file-separator tokens. Where several
# texts match, the first in this order wins (llama.cpp takes its hash map's first).
_TEXT_DETECTED = {
    "eot": ("tokenizer.ggml.eot_token_id", (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
        "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
        "<end_of_utterance>")),
    "eom": ("tokenizer.ggml.eom_token_id", ("<|eom_id|>",)),
    "fim_pad": ("tokenizer.ggml.fim_pad_token_id",
                ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    "fim_rep": ("tokenizer.ggml.fim_rep_token_id",
                ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    "fim_sep": ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",)),
}
# gpt-oss's harmony tokens are always rendered (llama.cpp makes them user-defined).
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]          # TokenType per id (after the EOG overrides)
    scores: list[float]
    ids: dict[str, int]


def read_vocab(md: dict[str, Any]) -> Vocab:
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError("tokenizer metadata: tokenizer.ggml.tokens is missing or empty")
    if not all(isinstance(t, str) for t in tokens):
        raise GGUFError("tokenizer metadata: tokenizer.ggml.tokens must be a list of strings")
    n = len(tokens)
    # An empty token could never be matched; llama.cpp renames it the same way.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    ids = {t: i for i, t in enumerate(tokens)}
    if len(ids) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise GGUFError(f"tokenizer metadata: duplicate token {t!r} has ids {seen[t]} and {i}")
            seen[t] = i
    types = _int_list(md, "tokenizer.ggml.token_type", n, default=TokenType.NORMAL)
    scores = md.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * n
    elif not isinstance(scores, list) or len(scores) < n:
        raise GGUFError(f"tokenizer metadata: tokenizer.ggml.scores has "
                        f"{len(scores) if isinstance(scores, list) else 'no'} entries for {n} tokens")
    return Vocab(tokens, types, [float(s) for s in scores[:n]], ids)


def _int_list(md: dict[str, Any], key: str, n: int, default: int) -> list[int]:
    value = md.get(key)
    if value is None:
        return [int(default)] * n
    if not isinstance(value, list) or len(value) < n or not all(isinstance(v, int) for v in value[:n]):
        raise GGUFError(f"tokenizer metadata: {key} must be a list of at least {n} integers")
    # Types llama.cpp does not know become UNDEFINED: never rendered, never matched.
    return [v if 0 <= v <= TokenType.BYTE else TokenType.UNDEFINED for v in value[:n]]


def token_id(md: dict[str, Any], key: str, n: int, default: int | None) -> int | None:
    """A special-token id from the metadata; out-of-range ids are ignored as in llama.cpp."""
    if default is not None and default >= n:
        default = None
    value = md.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or not 0 <= value < n:
        log.warning("tokenizer metadata: %s = %r is not a token id (vocab of %d); using %r",
                    key, value, n, default)
        return default
    return value


def end_of_generation(md: dict[str, Any], vocab: Vocab,
                       eos: int | None) -> tuple[dict[str, int | None], frozenset[int]]:
    """The EOT/EOM/FIM ids and the set of ids that end generation, as llama.cpp finds
    them. Retypes tokens in vocab.types the way llama.cpp does: tokens recognised by
    their text become control tokens (so they are not rendered as text)."""
    n, types = len(vocab.tokens), vocab.types
    found: dict[str, int | None] = {}
    for role, (key, texts) in _TEXT_DETECTED.items():
        tid = token_id(md, key, n, None)
        if tid is None:
            tid = next((i for t in texts if (i := vocab.ids.get(t)) is not None), None)
            if tid is not None:
                types[tid] = TokenType.CONTROL
        found[role] = tid
    eog = {found["fim_pad"], found["fim_rep"], found["fim_sep"], found["eot"], found["eom"], eos}
    for text in _EOG_TEXTS:
        if (tid := vocab.ids.get(text)) is not None:
            eog.add(tid)
            types[tid] = TokenType.CONTROL
    for text in _ALWAYS_RENDERED:
        if (tid := vocab.ids.get(text)) is not None:
            types[tid] = TokenType.USER_DEFINED
    eog.discard(None)
    # Harmony-style vocabularies end turns with <|return|>/<|call|>; <|end|> only
    # separates messages there, so llama.cpp drops it from the set.
    has = {vocab.tokens[i] for i in eog}
    has_call = "<|call|>" in has or "<|calls|>" in has
    if "<|end|>" in has and has_call and ("<|return|>" in has or "<|flush|>" in has):
        end = vocab.ids["<|end|>"]
        eog.discard(end)
        types[end] = TokenType.USER_DEFINED
    return found, frozenset(eog)

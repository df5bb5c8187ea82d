"""Tokenizer built from a GGUF vocabulary that reproduces llama.cpp token for token.

`tokenizer.ggml.model` picks the vocabulary model from a registry:

- "gpt2": byte-level BPE. The text is split into words by the pre-tokenizer's regexes
  (llama.cpp's, keyed by `tokenizer.ggml.pre`), each word's bytes are mapped to GPT-2's
  printable characters and merged by rank.
- "llama": SentencePiece BPE. Spaces become "▁", a space is prefixed, pieces merge by
  score, characters missing from the vocabulary fall back to <0xXX> byte tokens.

The merge loops run in the `tokenizers` library (Rust). Around them this module does
what llama.cpp's llama-vocab.cpp does: it splits the text at special tokens, adds
BOS/EOS, renders pieces, cleans up spaces when detokenizing, and decides which tokens
end generation. The vectors in ../shared/data/vocab (llama.cpp's test-tokenizer-0) are
the proof; tests/test_tokenizer.py checks every one.
"""
from __future__ import annotations

import codecs
import enum
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from alphallama.gguf.reader import GGUFError, GGUFFile

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
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)


# ---------------------------------------------------------------------------
# Pre-tokenizers of byte-level BPE vocabularies (llama.cpp's regexes, applied in order;
# each one splits the pieces left by the previous one into matches and the gaps between)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# The contractions are spelled out case by case instead of (?i:...): case folding
# would also match e.g. "ſ" (long s), which llama.cpp's pattern does not.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's rewrite of GPT-4o's pattern: "(?=\p{L})[^a-z]" stands for "a letter that
# is not ASCII lower case", which is what llama.cpp matches (not Unicode case classes).
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text, and llama.cpp's per-type defaults."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is emitted whole (Llama 3)
    clean_spaces: bool = True    # decode() removes the space in " ," " 's" etc.
    add_bos: bool = False        # used when the file has no tokenizer.ggml.add_bos_token


_DEFAULT_PRE = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _register(names: str, pre: PreTokenizer) -> None:
    for name in names.split():
        _PRE_TOKENIZERS[name] = pre


_register("default", _DEFAULT_PRE)
_register("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
          PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True))
_register("dbrx smaug-bpe", PreTokenizer((_LLAMA3,)))
_register("qwen2 deepseek-r1-qwen kormo hunyuan", PreTokenizer((_QWEN2,), clean_spaces=False))
_register("stablelm2 megrez", PreTokenizer((_QWEN2,)))
_register("qwen35", PreTokenizer((_QWEN35,), clean_spaces=False))
_register("gpt-2 phi-2 mpt olmo jais exaone4 jina-es jina-de gigachat a.x-4.0 mellum",
          PreTokenizer((_GPT2,)))
_register("trillion granite-docling", PreTokenizer((_GPT2,), clean_spaces=False))
_register("starcoder refact codeshell exaone minerva-7b", PreTokenizer((r"\p{N}", _GPT2)))
_register("command-r smollm", PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False))
_register("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")))
_register("gpt-4o llama4 kanana2", PreTokenizer((_GPT4O,), clean_spaces=False))
_register("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, clean_spaces=False, add_bos=True))


def known_pre_tokenizers() -> list[str]:
    return sorted(_PRE_TOKENIZERS)


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer named by `tokenizer.ggml.pre`. A missing name means llama.cpp's
    'default' (with a warning); an unknown one is refused, as llama.cpp refuses it: a
    guessed split would tokenize silently wrong."""
    if name is None or name == "":
        log.warning("tokenizer metadata has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                    "pre-tokenizer (generation quality may suffer; reconvert the model)")
        return _DEFAULT_PRE
    if name not in _PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer metadata: unknown pre-tokenizer tokenizer.ggml.pre={name!r} "
                        f"(known: {', '.join(known_pre_tokenizers())})")
    return _PRE_TOKENIZERS[name]


def hf_pre_tokenizer(pre: PreTokenizer) -> hf_pre.PreTokenizer:
    """The `tokenizers` pipeline for a byte-level vocabulary: each regex splits the text
    into matches and the gaps between them, then bytes map to GPT-2 characters."""
    return hf_pre.Sequence([hf_pre.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                           + [hf_pre.ByteLevel(add_prefix_space=False, use_regex=False)])


# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# The vocabulary as the file gives it, after llama.cpp's checks

@dataclass
class _Vocab:
    tokens: list[str]
    types: list[int]          # TokenType per id (after the EOG overrides)
    scores: list[float]
    ids: dict[str, int]


def _read_vocab(md: dict[str, Any]) -> _Vocab:
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
    return _Vocab(tokens, types, [float(s) for s in scores[:n]], ids)


def _int_list(md: dict[str, Any], key: str, n: int, default: int) -> list[int]:
    value = md.get(key)
    if value is None:
        return [int(default)] * n
    if not isinstance(value, list) or len(value) < n or not all(isinstance(v, int) for v in value[:n]):
        raise GGUFError(f"tokenizer metadata: {key} must be a list of at least {n} integers")
    # Types llama.cpp does not know become UNDEFINED: never rendered, never matched.
    return [v if 0 <= v <= TokenType.BYTE else TokenType.UNDEFINED for v in value[:n]]


def _token_id(md: dict[str, Any], key: str, n: int, default: int | None) -> int | None:
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


def _end_of_generation(md: dict[str, Any], vocab: _Vocab,
                       eos: int | None) -> tuple[dict[str, int | None], frozenset[int]]:
    """The EOT/EOM/FIM ids and the set of ids that end generation, as llama.cpp finds
    them. Retypes tokens in vocab.types the way llama.cpp does: tokens recognised by
    their text become control tokens (so they are not rendered as text)."""
    n, types = len(vocab.tokens), vocab.types
    found: dict[str, int | None] = {}
    for role, (key, texts) in _TEXT_DETECTED.items():
        tid = _token_id(md, key, n, None)
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


# ---------------------------------------------------------------------------
# Vocabulary models

class _Model(Protocol):
    """What the Tokenizer needs from a vocabulary model."""
    add_bos: bool              # llama.cpp's default for the model (metadata may override)
    add_space_prefix: bool     # SPM prefixes a space; decode() strips it again
    clean_spaces: bool
    default_bos: int | None
    default_eos: int | None

    def encode_fragment(self, text: str, after_special: bool) -> list[int]: ...
    def normal_piece(self, text: str) -> bytes: ...


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from 256 upward, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _ByteLevelBPE:
    """tokenizer.ggml.model = "gpt2"."""

    add_space_prefix = False

    def __init__(self, md: dict[str, Any], vocab: _Vocab):
        n = len(vocab.tokens)
        self.default_bos = self.default_eos = 11 if n > 11 else None  # llama.cpp's GPT-2 defaults
        pre = pre_tokenizer(md.get("tokenizer.ggml.pre"))
        self.pre = pre
        self.add_bos, self.clean_spaces = pre.add_bos, pre.clean_spaces
        self._hf = _HFTokenizer(self._bpe_model(md, vocab, pre.ignore_merges))
        self._hf.pre_tokenizer = hf_pre_tokenizer(pre)

    @staticmethod
    def _bpe_model(md: dict[str, Any], vocab: _Vocab, ignore_merges: bool) -> hf_models.BPE:
        merges = md.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise GGUFError("tokenizer metadata: a gpt2 tokenizer needs tokenizer.ggml.merges "
                            "(a list of 'left right' strings)")
        # llama.cpp splits at the first space after the first character.
        pairs = [(m[:i], m[i + 1:]) for m in merges if (i := m.find(" ", 1)) > 0]
        try:
            return hf_models.BPE(vocab.ids, pairs, ignore_merges=ignore_merges)
        except Exception:
            # A merge whose halves or result are not tokens can never fire in llama.cpp;
            # `tokenizers` refuses it, so drop those (slow path, broken files only).
            ok = [(a, b) for a, b in pairs if a in vocab.ids and b in vocab.ids and a + b in vocab.ids]
            log.warning("tokenizer metadata: ignoring %d merges that name unknown tokens",
                        len(pairs) - len(ok))
            return hf_models.BPE(vocab.ids, ok, ignore_merges=ignore_merges)

    def encode_fragment(self, text: str, after_special: bool) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def normal_piece(self, text: str) -> bytes:
        try:
            return bytes([_CHAR_TO_BYTE[c] for c in text])
        except KeyError:
            return _unknown_bytes_piece(text)


def _unknown_bytes_piece(text: str) -> bytes:
    """llama.cpp's rendering of a byte-level token with characters outside GPT-2's table."""
    out = bytearray()
    for c in text:
        if c in _CHAR_TO_BYTE:
            out.append(_CHAR_TO_BYTE[c])
        else:
            out += f"[UNK_BYTE_0x{c.encode().hex()}{text}]".encode()
    return bytes(out)


class _SentencePieceBPE:
    """tokenizer.ggml.model = "llama".

    llama.cpp merges, anywhere in the text, the adjacent pair whose concatenation is the
    vocabulary token of highest score (ties: leftmost). That is BPE with one merge rule
    per way of cutting a token into two tokens, ranked by the token's score, which is
    what is built here; `tokenizers` also applies a rule leftmost first. Tokens of equal
    score are ranked by id, which tests/test_tokenizer.py checks against a
    re-implementation of llama.cpp's loop."""

    add_bos = True
    clean_spaces = False
    default_bos, default_eos = 1, 2

    def __init__(self, md: dict[str, Any], vocab: _Vocab):
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        rules = []
        for tid, text in enumerate(vocab.tokens):
            for cut in range(1, len(text)):
                left, right = text[:cut], text[cut:]
                if left in vocab.ids and right in vocab.ids:
                    rules.append((-vocab.scores[tid], tid, cut, left, right))
        rules.sort()
        model = hf_models.BPE(vocab.ids, [(a, b) for *_, a, b in rules], byte_fallback=True)
        self._hf = _HFTokenizer(model)  # no pre-tokenizer: the whole fragment is one word

    def encode_fragment(self, text: str, after_special: bool) -> list[int]:
        # llama.cpp prefixes the space to the first fragment and to every fragment that
        # follows a special token, then escapes all spaces.
        if self.add_space_prefix and after_special:
            text = " " + text
        return self._hf.encode(text.replace(" ", "▁"), add_special_tokens=False).ids

    def normal_piece(self, text: str) -> bytes:
        return text.replace("▁", " ").encode()


_MODELS: dict[str, Callable[[dict[str, Any], _Vocab], _Model]] = {
    "gpt2": _ByteLevelBPE,
    "llama": _SentencePieceBPE,
}


# ---------------------------------------------------------------------------
# Detokenizer: llama.cpp's clean-up of spaces before punctuation and contractions

_CLEANUPS = (
    (re.compile(rb" (?=[?!.,])"), b""),           # " ?" " !" " ." " ,"
    (re.compile(rb" ' "), b"'"),                   # a lone apostrophe between spaces
    (re.compile(rb" '(?=s|m|re|ve)"), b"'"),      # " 's" " 'm" " 're" " 've" (not 't 'd 'll)
)


def _clean_spaces(text: bytes) -> bytes:
    for pattern, repl in _CLEANUPS:
        text = pattern.sub(repl, text)
    return text


class Detokenizer:
    """Incremental detokenization for streaming: feed ids, get text that is safe to show.

    Bytes of a character split across tokens are held back until the character is
    complete, so a piece never ends in half a UTF-8 sequence; invalid bytes become
    U+FFFD. Pieces are concatenated as llama.cpp's server streams them: no leading-space
    strip, no space clean-up (those are decode()'s, for whole texts)."""

    def __init__(self, tokenizer: "Tokenizer", special: bool = False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id, special=self._special))

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        """The held-back bytes of an unfinished character, as U+FFFD; resets the stream."""
        return self._utf8.decode(b"", final=True)


# ---------------------------------------------------------------------------

class Tokenizer:
    """A GGUF vocabulary's tokenizer, token-identical to llama.cpp."""

    def __init__(self, md: dict[str, Any]):
        model_name = md.get("tokenizer.ggml.model")
        if model_name is None:
            raise GGUFError("tokenizer metadata: tokenizer.ggml.model is missing")
        if model_name not in _MODELS:
            raise GGUFError(f"tokenizer metadata: unsupported tokenizer.ggml.model={model_name!r} "
                            f"(supported: {', '.join(sorted(_MODELS))})")
        vocab = _read_vocab(md)
        self.model_name: str = model_name
        self.pre_name: str | None = md.get("tokenizer.ggml.pre")
        self._model = _MODELS[model_name](md, vocab)
        n = len(vocab.tokens)
        m = self._model
        self._bos = _token_id(md, "tokenizer.ggml.bos_token_id", n, m.default_bos)
        self._eos = _token_id(md, "tokenizer.ggml.eos_token_id", n, m.default_eos)
        self._add_bos = bool(md.get("tokenizer.ggml.add_bos_token", m.add_bos))
        self._add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if self._add_bos and self._bos is None:
            raise GGUFError("tokenizer metadata: add_bos_token is true but there is no BOS token id")
        if self._add_eos and self._eos is None:
            raise GGUFError("tokenizer metadata: add_eos_token is true but there is no EOS token id")
        self._add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", m.add_space_prefix))
        self._vocab = vocab
        self._special_ids, self._eog = _end_of_generation(md, vocab, self._eos)
        # Special tokens are split out longest first, as llama.cpp does.
        self._specials = sorted(
            ((vocab.tokens[i], i) for i, t in enumerate(vocab.types) if t in _SPECIAL_TYPES),
            key=lambda s: (-len(s[0].encode()), s[1]))
        self._pieces = [self._render(i) for i in range(n)]

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "Tokenizer":
        return cls(md)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        return cls(GGUFFile(path).metadata)

    # -- encoding -------------------------------------------------------------

    def _split_special(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut the text at special-token pieces: a list of text fragments and token ids.

        Longest pieces first; each cuts every fragment at all its occurrences (this is
        llama.cpp's order, which decides overlapping matches)."""
        parts: list[str | int] = [text] if text else []
        for piece, tid in self._specials:
            if not parse_special and self._vocab.types[tid] != TokenType.USER_DEFINED:
                continue
            if piece not in text:
                continue
            cut: list[str | int] = []
            for part in parts:
                if isinstance(part, int) or piece not in part:
                    cut.append(part)
                    continue
                for k, chunk in enumerate(part.split(piece)):
                    if k:
                        cut.append(tid)
                    if chunk:
                        cut.append(chunk)
            parts = cut
        return parts

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`.

        add_special adds BOS/EOS as the model's metadata asks (llama.cpp's add_special);
        parse_special turns control-token text such as "<|im_start|>" in `text` into the
        token itself (use it for rendered chat templates, never for untrusted user text)."""
        ids: list[int] = []
        if add_special and self._add_bos:
            ids.append(self._bos)
        after_special = True   # SPM prefixes a space to the first fragment
        for part in self._split_special(text, parse_special):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
            else:
                ids += self._model.encode_fragment(part, after_special)
                after_special = False
        if add_special and self._add_eos:
            ids.append(self._eos)
        return ids

    # -- decoding -------------------------------------------------------------

    def _render(self, tid: int) -> bytes:
        """The bytes of a token with special=True (control tokens as their text)."""
        text, ttype = self._vocab.tokens[tid], self._vocab.types[tid]
        if ttype in _SPECIAL_TYPES:
            return text.encode()
        if ttype == TokenType.NORMAL:
            return self._model.normal_piece(text)
        if ttype == TokenType.BYTE:
            if _BYTE_TOKEN.fullmatch(text):
                return bytes([int(text[3:5], 16)])
            return self._model.normal_piece(text)   # a byte spelled as its character
        return b""                                  # unused / undefined: nothing

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for. With special=False, control and unknown tokens
        render as nothing (user-defined ones always render), as in llama.cpp."""
        if not 0 <= token_id < len(self._pieces):
            raise IndexError(f"token id {token_id} is outside the vocabulary of {len(self._pieces)}")
        if not special and self._vocab.types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN):
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], special: bool = True, continuation: bool = False) -> str:
        """Text of a token sequence.

        By default the sequence is a whole text and this is llama.cpp's detokenize (the
        inverse of encode): the space an SPM vocabulary prefixes is stripped from the
        first token, and vocabularies that ask for it get the spaces before punctuation
        and contractions removed.

        continuation=True is for tokens that continue earlier text, such as generated
        ones: pieces are joined as they are, which is what llama.cpp's server returns
        and what stream() yields (an SPM "▁was" keeps its space)."""
        pieces = [self.token_to_piece(i, special) for i in ids]
        if continuation:
            return b"".join(pieces).decode("utf-8", errors="replace")
        if self._add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        out = b"".join(pieces)
        if self._model.clean_spaces:
            out = _clean_spaces(out)
        return out.decode("utf-8", errors="replace")

    def stream(self, special: bool = False) -> Detokenizer:
        """An incremental detokenizer for generated tokens."""
        return Detokenizer(self, special)

    # -- vocabulary facts ----------------------------------------------------

    def id_of(self, piece: str) -> int | None:
        """The id of a token given its vocabulary text (e.g. "<|im_end|>", "Ġthe", "▁the")."""
        return self._vocab.ids.get(piece)

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(self._vocab.types[token_id])

    def is_stop(self, token_id: int) -> bool:
        return token_id in self._eog

    @property
    def vocab_size(self) -> int:
        return len(self._vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def eot_id(self) -> int | None:
        return self._special_ids["eot"]

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation (llama.cpp's EOG set: EOS, EOT, EOM, FIM pad/repo/sep
        and control tokens such as <|im_end|>, <|endoftext|>, <|eot_id|>)."""
        return self._eog

    eot_ids = stop_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model_name!r}, pre={self.pre_name!r}, vocab={self.vocab_size}, "
                f"bos={self._bos}, eos={self._eos}, add_bos={self._add_bos})")

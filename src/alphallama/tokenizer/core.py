"""The Tokenizer (llama.cpp's llama-vocab.cpp around the vocabulary model: special-token
splitting, BOS/EOS, piece rendering, space clean-up, end of generation) and the
incremental Detokenizer for streaming."""
from __future__ import annotations

import codecs
import os
import re
from typing import Any, Iterable

from alphallama.gguf.reader import GGUFError, GGUFFile

from .models import MODELS
from .vocab import SPECIAL_TYPES, TokenType, end_of_generation, read_vocab, token_id

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


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
        if model_name not in MODELS:
            raise GGUFError(f"tokenizer metadata: unsupported tokenizer.ggml.model={model_name!r} "
                            f"(supported: {', '.join(sorted(MODELS))})")
        vocab = read_vocab(md)
        self.model_name: str = model_name
        self.pre_name: str | None = md.get("tokenizer.ggml.pre")
        self._model = MODELS[model_name](md, vocab)
        n = len(vocab.tokens)
        m = self._model
        self._bos = token_id(md, "tokenizer.ggml.bos_token_id", n, m.default_bos)
        self._eos = token_id(md, "tokenizer.ggml.eos_token_id", n, m.default_eos)
        self._add_bos = bool(md.get("tokenizer.ggml.add_bos_token", m.add_bos))
        self._add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        if self._add_bos and self._bos is None:
            raise GGUFError("tokenizer metadata: add_bos_token is true but there is no BOS token id")
        if self._add_eos and self._eos is None:
            raise GGUFError("tokenizer metadata: add_eos_token is true but there is no EOS token id")
        self._add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", m.add_space_prefix))
        self._vocab = vocab
        self._special_ids, self._eog = end_of_generation(md, vocab, self._eos)
        # Special tokens are split out longest first, as llama.cpp does.
        self._specials = sorted(
            ((vocab.tokens[i], i) for i, t in enumerate(vocab.types) if t in SPECIAL_TYPES),
            key=lambda s: (-len(s[0].encode()), s[1]))
        self._pieces = [self._render(i) for i in range(n)]
        # No token spells more bytes than this: a text of more than ctx * this many
        # characters cannot fit a context of ctx tokens, whatever it tokenizes to.
        self.max_piece_bytes: int = max(map(len, self._pieces), default=1) or 1

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

    def encode_running(self, text: str) -> list[int]:
        """Token ids of `text` as it stands inside running text: no BOS/EOS, no SPM space
        prefix, control-token text not parsed; their pieces spell exactly `text` (a grammar
        library tokenizes the bytes it forces with this: encode's prefixed space would make
        it force " r" where the grammar wants "r")."""
        return self._model.encode_fragment(text, after_special=False) if text else []

    # -- decoding -------------------------------------------------------------

    def _render(self, tid: int) -> bytes:
        """The bytes of a token with special=True (control tokens as their text)."""
        text, ttype = self._vocab.tokens[tid], self._vocab.types[tid]
        if ttype in SPECIAL_TYPES:
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

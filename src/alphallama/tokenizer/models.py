"""Vocabulary models, picked by `tokenizer.ggml.model`: "gpt2" (byte-level BPE) and
"llama" (SentencePiece BPE). Their merge loops run in the `tokenizers` library."""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as hf_models

from alphallama.gguf.reader import GGUFError

from .pretokenize import hf_pre_tokenizer, pre_tokenizer
from .vocab import Vocab

log = logging.getLogger(__name__)


class VocabModel(Protocol):
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


class _ByteLevelBPE:
    """tokenizer.ggml.model = "gpt2"."""

    add_space_prefix = False

    def __init__(self, md: dict[str, Any], vocab: Vocab):
        n = len(vocab.tokens)
        self.default_bos = self.default_eos = 11 if n > 11 else None  # llama.cpp's GPT-2 defaults
        pre = pre_tokenizer(md.get("tokenizer.ggml.pre"))
        self.pre = pre
        self.add_bos, self.clean_spaces = pre.add_bos, pre.clean_spaces
        self._hf = _HFTokenizer(self._bpe_model(md, vocab, pre.ignore_merges))
        self._hf.pre_tokenizer = hf_pre_tokenizer(pre)

    @staticmethod
    def _bpe_model(md: dict[str, Any], vocab: Vocab, ignore_merges: bool) -> hf_models.BPE:
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

    def __init__(self, md: dict[str, Any], vocab: Vocab):
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


MODELS: dict[str, Callable[[dict[str, Any], Vocab], VocabModel]] = {
    "gpt2": _ByteLevelBPE,
    "llama": _SentencePieceBPE,
}

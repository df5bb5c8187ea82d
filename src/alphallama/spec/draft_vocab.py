"""Script-adaptive draft vocabulary: which output rows the MTP head scores.

Scoring all of a 152k-row head costs more than the MTP block itself, so the head scores a
fixed number of rows. The baseline takes the first N token ids (BPE ids follow merge
order, so these are the most frequent pieces of the tokenizer's training mix, mostly
English and code); a reply in Russian or Hindi then draws most of its tokens from rows
the head never scores, and cannot be drafted at all.

Here every token is put in one class once per tokenizer, from its decoded bytes: a
writing system (Latin, Cyrillic, Han, ...), "common" (digits, punctuation, whitespace),
"special" (control tokens: end of turn), "bytes" (fragments of a character too short to
tell its script), "symbol", "other" letters, or "unused". Per request, the scripts of
the prompt's letters pick the subset: the special and bytes classes whole; then the
rest of the budget is shared equally by a base pool (Latin and common tokens, always:
code, names, markup, digits and punctuation) and each other script of the prompt, every
pool taking its lowest ids first (a pool smaller than its share gives the remainder to
the others); rows still left are filled with the remaining tokens in id order. An
English prompt so gets the first ids minus other scripts' tokens (never less coverage
of Latin text than the first-N baseline); same size, same cost, different rows.
"""
from __future__ import annotations

import bisect
import codecs
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..config import DEFAULTS

# script -> code point ranges (inclusive). Letters outside these are "other".
SCRIPTS: dict[str, tuple[tuple[int, int], ...]] = {
    "latin": ((0x41, 0x5A), (0x61, 0x7A), (0xAA, 0xAA), (0xBA, 0xBA), (0xC0, 0xD6), (0xD8, 0xF6),
              (0xF8, 0x24F), (0x1E00, 0x1EFF), (0x2C60, 0x2C7F), (0xA720, 0xA7FF), (0xFF21, 0xFF3A),
              (0xFF41, 0xFF5A)),
    "greek": ((0x370, 0x3FF), (0x1F00, 0x1FFF)),
    "cyrillic": ((0x400, 0x52F), (0x1C80, 0x1C8F), (0x2DE0, 0x2DFF), (0xA640, 0xA69F)),
    "armenian": ((0x530, 0x58F),),
    "hebrew": ((0x590, 0x5FF), (0xFB1D, 0xFB4F)),
    "arabic": ((0x600, 0x6FF), (0x750, 0x77F), (0x8A0, 0x8FF), (0xFB50, 0xFDFF), (0xFE70, 0xFEFF)),
    "devanagari": ((0x900, 0x97F), (0xA8E0, 0xA8FF)),
    "bengali": ((0x980, 0x9FF),),
    "tamil": ((0xB80, 0xBFF),),
    "thai": ((0xE00, 0xE7F),),
    "georgian": ((0x10A0, 0x10FF),),
    "hangul": ((0x1100, 0x11FF), (0x3130, 0x318F), (0xAC00, 0xD7AF)),
    "kana": ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F)),
    "han": ((0x2E80, 0x2FDF), (0x3005, 0x3007), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
            (0x20000, 0x2FA1F)),
    # not letters, but only text in these scripts uses them: 。、「」（），
    "cjk_punct": ((0x3000, 0x3004), (0x3008, 0x303F), (0xFF01, 0xFF20), (0xFF3B, 0xFF40), (0xFF5B, 0xFF65)),
}
COMPANIONS = {"han": ("cjk_punct",), "kana": ("cjk_punct",), "hangul": ("cjk_punct",)}
BASE = ("latin", "common")                 # one pool in every subset: code, names, digits, punctuation
CORE = ("special", "bytes")                # in every subset, whole
# Not letters, yet part of plain text in any language: general punctuation (“ ” – …)
_COMMON_EXTRA = ((0x2000, 0x206F),)

_TABLE = sorted((lo, hi, name) for name, rs in SCRIPTS.items() for lo, hi in rs)
_STARTS = [lo for lo, _, _ in _TABLE]


def script_of(cp: int) -> str | None:
    """The script of a code point, or None."""
    i = bisect.bisect_right(_STARTS, cp) - 1
    if i >= 0 and cp <= _TABLE[i][1]:
        return _TABLE[i][2]
    return None


def char_class(ch: str) -> str:
    cp = ord(ch)
    s = script_of(cp)
    if s is not None:
        return s
    if cp < 0x80 or ch.isspace() or any(lo <= cp <= hi for lo, hi in _COMMON_EXTRA):
        return "common"
    if ch.isalpha():
        return "other"
    if 0x300 <= cp <= 0x36F:    # combining marks attach to the letter before them
        return "mark"
    return "symbol"


def _fragment_class(lead: bytes) -> str:
    """An incomplete UTF-8 sequence at the end of a token: the script of the code points
    it could start, when both ends of that range agree; else "bytes"."""
    n = 2 if lead[0] >> 5 == 0b110 else 3 if lead[0] >> 4 == 0b1110 else 4 if lead[0] >> 3 == 0b11110 else 0
    if n == 0:
        return "bytes"
    bits = lead[0] & (0x7F >> n)
    for b in lead[1:]:
        bits = (bits << 6) | (b & 0x3F)
    free = 6 * (n - len(lead))
    lo, hi = bits << free, (bits << free) | ((1 << free) - 1)
    a, b = script_of(lo), script_of(hi)
    return a if a is not None and a == b else "bytes"


def bytes_class(piece: bytes) -> str:
    """The class of a token's bytes: the most frequent script of its letters, else
    "common"/"symbol" by its other characters, else a fragment's inferred script."""
    i = 0
    while i < len(piece) and 0x80 <= piece[i] < 0xC0:   # starts inside a character
        i += 1
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    text = dec.decode(piece[i:], final=False)
    tail = dec.getstate()[0]
    counts = Counter(char_class(c) for c in text if c != "\ufffd")
    letters = [(n, s) for s, n in counts.items() if s in SCRIPTS or s == "other"]
    if letters:
        return max(letters, key=lambda t: (t[0], t[1]))[1]
    if tail:
        return _fragment_class(tail)
    if i > 0 or "\ufffd" in text:
        return "bytes"
    if not counts or set(counts) <= {"common", "mark"}:
        return "common" if counts else "bytes"
    return "symbol"


def prompt_scripts(text: str, min_chars: int = DEFAULTS.mtp.script_min_chars) -> list[str]:
    """The scripts with at least min_chars letters in `text`, most frequent first."""
    counts = Counter(s for s in map(char_class, text) if s in SCRIPTS and s != "cjk_punct")
    return [s for s, n in counts.most_common() if n >= min_chars]


@dataclass
class DraftVocab:
    classes: np.ndarray           # [V] class index per token id
    names: list[str]              # class index -> name

    @classmethod
    def from_tokenizer(cls, tok) -> "DraftVocab":
        """Classify every token of `tok` (alphallama.tokenizer.Tokenizer) once."""
        from ..tokenizer import TokenType
        kinds = {TokenType.CONTROL: "special", TokenType.USER_DEFINED: "special",
                 TokenType.UNUSED: "unused", TokenType.BYTE: "bytes"}
        labels = []
        for i in range(tok.vocab_size):
            kind = kinds.get(tok.token_type(i))
            labels.append(kind if kind is not None else bytes_class(tok.token_to_piece(i, special=True)))
        return cls.from_labels(labels)

    @classmethod
    def from_labels(cls, labels: list[str]) -> "DraftVocab":
        names = sorted(set(labels))
        index = {n: i for i, n in enumerate(names)}
        return cls(np.array([index[s] for s in labels], dtype=np.int16), names)

    @property
    def size(self) -> int:
        return len(self.classes)

    def ids_of(self, name: str) -> np.ndarray:
        """Token ids of a class, ascending."""
        if name not in self.names:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.classes == self.names.index(name))

    def counts(self) -> dict[str, int]:
        return {n: int(c) for n, c in zip(self.names, np.bincount(self.classes, minlength=len(self.names)))}

    def fixed(self, n: int) -> np.ndarray:
        """The baseline: the first n ids."""
        return np.arange(min(n, self.size))

    def subset(self, scripts: Iterable[str], n: int = DEFAULTS.mtp.draft_vocab) -> np.ndarray:
        """n token ids (ascending) for a request whose prompt is written in `scripts`."""
        if n >= self.size:
            return np.arange(self.size)
        core = np.concatenate([self.ids_of(c) for c in CORE])
        if len(core) >= n:
            return np.sort(core)[:n]
        pools = {"base": np.sort(np.concatenate([self.ids_of(c) for c in BASE]))}
        for s in scripts:
            for c in (s, *COMPANIONS.get(s, ())):
                if c not in pools and c not in BASE:
                    pools[c] = self.ids_of(c)
        take = _water_fill({c: len(p) for c, p in pools.items()}, n - len(core))
        chosen = [core] + [pools[c][:k] for c, k in take.items()]
        picked = np.concatenate(chosen)
        left = n - len(picked)
        if left > 0:   # every wanted script is whole: fill with the rest, lowest ids first
            mask = np.ones(self.size, dtype=bool)
            mask[picked] = False
            mask[self.ids_of("unused")] = False
            rest = np.flatnonzero(mask)[:left]
            picked = np.concatenate([picked, rest])
        return np.sort(picked)

    def subset_for_text(self, text: str, n: int = DEFAULTS.mtp.draft_vocab) -> np.ndarray:
        return self.subset(prompt_scripts(text), n)


def _water_fill(sizes: dict[str, int], budget: int) -> dict[str, int]:
    """Split `budget` equally among the pools; a pool smaller than its share takes all
    of itself and the rest is split again among the others. Leftover from rounding goes
    to the pools in order."""
    take = {c: 0 for c in sizes}
    open_ = [c for c in sizes if sizes[c] > 0]
    while budget > 0 and open_:
        share = budget // len(open_)
        if share == 0:   # fewer rows than pools: one each, in order
            for c in open_[:budget]:
                take[c] += 1
            break
        still = []
        for c in open_:
            k = min(share, sizes[c] - take[c])
            take[c] += k
            budget -= k
            if take[c] < sizes[c]:
                still.append(c)
        open_ = still
    return take

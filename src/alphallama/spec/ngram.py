"""The n-gram copy drafter: find the most recent tokens earlier in the prompt or the
output, and propose what followed them there.

Index: every n-gram of length `ngram_min` maps to the end positions where it occurred
(the most recent `max_candidates`). A lookup takes the current suffix's n-gram,
extends each candidate match backwards (up to `max_match`) and keeps the longest,
the most recent on ties. Per token the work is bounded by these two constants, not by
the context length.

Continuations may run into the current end of the sequence (a repeating pattern); the
drafter then keeps copying with the period the match implies, so "a b a b" drafts
"a b a b ..." rather than stopping short.
"""
from __future__ import annotations

from collections import defaultdict, deque

from ..config import DEFAULTS
from .drafter import NO_DRAFT, Draft


class NgramDrafter:
    name = "ngram"

    def __init__(self, ngram_min: int = DEFAULTS.spec.ngram_min, draft_max: int = 64,
                 max_candidates: int = 8, max_match: int = 64):
        if ngram_min < 1:
            raise ValueError("ngram_min must be >= 1")
        self.n = ngram_min
        self.draft_max = draft_max
        self.max_candidates = max_candidates
        self.max_match = max_match
        self.seq: list[int] = []
        self.index: dict[tuple[int, ...], deque[int]] = defaultdict(lambda: deque(maxlen=self.max_candidates))

    def begin(self, prompt_ids: list[int]) -> None:
        self.seq = []
        self.index.clear()
        self.accept(prompt_ids)

    def accept(self, tokens: list[int]) -> None:
        for t in tokens:
            self.seq.append(t)
            end = len(self.seq) - 1
            if end >= self.n - 1:
                self.index[tuple(self.seq[end - self.n + 1:end + 1])].append(end)

    def best_match(self) -> tuple[int, int]:
        """(end position of the best earlier match of the current suffix, its length); (-1, 0) if none."""
        s, L = self.seq, len(self.seq)
        if L < self.n + 1:
            return -1, 0
        key = tuple(s[L - self.n:])
        best_end, best_len = -1, 0
        for end in reversed(self.index.get(key, ())):
            if end >= L - 1:          # the suffix itself
                continue
            m = self.n
            while m < self.max_match and end - m >= 0 and s[end - m] == s[L - 1 - m]:
                m += 1
            if m > best_len:
                best_end, best_len = end, m
        return best_end, best_len

    def propose(self, max_n: int) -> Draft:
        end, m = self.best_match()
        max_n = min(max_n, self.draft_max)
        if end < 0 or max_n <= 0:
            return NO_DRAFT
        s, L = self.seq, len(self.seq)
        period = L - 1 - end
        out: list[int] = []
        for k in range(max_n):
            i = end + 1 + k
            while i >= L:             # past the end: the match repeats with this period
                i -= period
            out.append(s[i])
        return Draft(out, self.name, m)

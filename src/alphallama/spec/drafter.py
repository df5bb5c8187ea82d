"""The drafter lifecycle (as llama.cpp's drafters): begin -> propose -> accept.

    d.begin(prompt_ids)           # a new request: index the prompt
    draft = d.propose(max_n)      # up to max_n tokens that may follow the sequence so far
    d.accept(tokens)              # the tokens the round committed (accepted drafts + bonus)

A drafter only sees committed tokens; it never needs to undo anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Draft:
    tokens: list[int] = field(default_factory=list)
    source: str = "none"          # which drafter made it
    match_len: int = 0            # copy drafter: length of the suffix match behind it
    probs: tuple[float, ...] = ()  # MTP drafter: the head's probability of each draft token

    def __len__(self) -> int:
        return len(self.tokens)


NO_DRAFT = Draft()


class Drafter(Protocol):
    name: str

    def begin(self, prompt_ids: list[int]) -> None: ...

    def propose(self, max_n: int) -> Draft: ...

    def accept(self, tokens: list[int]) -> None: ...


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items two token lists share (how many drafts the tokens that
    followed confirm; how much of a cached sequence a new prompt re-uses)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

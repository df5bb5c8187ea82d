"""Speculation settings and the drafter registry."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import DEFAULTS
from .drafter import Drafter
from .ngram import NgramDrafter


@dataclass(frozen=True)
class SpecConfig:
    spec_type: str = DEFAULTS.spec.spec_type   # none | ngram
    draft_max: int = DEFAULTS.spec.draft_max
    ngram_min: int = DEFAULTS.spec.ngram_min
    fast: bool = DEFAULTS.spec.fast            # verify rows batched: may differ from plain decoding in near-ties

    def validate(self) -> None:
        if self.spec_type not in DRAFTERS:
            raise ValueError(f"unknown --spec-type {self.spec_type!r} (choose from {', '.join(DRAFTERS)})")
        if not 1 <= self.draft_max <= 64:
            raise ValueError(f"--spec-draft-max must be in 1..64, got {self.draft_max}")
        if self.ngram_min < 1:
            raise ValueError(f"--spec-ngram-min must be >= 1, got {self.ngram_min}")

    def make_drafter(self, engine=None) -> Drafter | None:
        """A drafter for one request; `engine` gives drafters that need the model (MTP)
        its head and state."""
        self.validate()
        factory = DRAFTERS[self.spec_type]
        return factory(self) if factory else None

    @property
    def mode(self) -> str:
        return "fast (not token-identical)" if self.fast else "exact"


DRAFTERS: dict[str, Callable[[SpecConfig], Drafter] | None] = {
    "none": None,
    "ngram": lambda c: NgramDrafter(ngram_min=c.ngram_min, draft_max=c.draft_max),
}


def add_spec_arguments(p) -> None:
    """`--spec-type`, `--spec-draft-max`, `--spec-ngram-min`, `--fast` for run and serve."""
    p.add_argument("--spec-type", default=DEFAULTS.spec.spec_type, choices=list(DRAFTERS),
                   help="speculative drafter")
    p.add_argument("--spec-draft-max", type=int, default=DEFAULTS.spec.draft_max, help="most drafts per round")
    p.add_argument("--spec-ngram-min", type=int, default=DEFAULTS.spec.ngram_min,
                   help="shortest suffix match the copy drafter acts on")
    p.add_argument("--fast", action="store_true",
                   help="fast mode: batched verify, may differ from plain greedy in near-ties")


def spec_from_args(args) -> SpecConfig:
    cfg = SpecConfig(args.spec_type, args.spec_draft_max, args.spec_ngram_min, args.fast)
    cfg.validate()
    return cfg

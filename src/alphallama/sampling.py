"""Sampling: greedy, or temperature with top-k / top-p / min-p, seeded.

`Sampler.distribution` gives the final probability vector a token is drawn from, so
speculative sampling can accept/reject against exactly the distribution plain
sampling uses. Filter order follows llama.cpp's default chain: top-k, top-p, min-p,
then temperature.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DEFAULTS

# Temperatures below this sample as this: float32 logits divided by less overflow, and
# the distribution is already one-hot to float32 precision long before.
_MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULTS.sampling.temperature
    top_k: int = DEFAULTS.sampling.top_k
    top_p: float = DEFAULTS.sampling.top_p
    min_p: float = DEFAULTS.sampling.min_p
    seed: int | None = DEFAULTS.sampling.seed

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def validate(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.gen = torch.Generator()
        self.gen.manual_seed(params.seed if params.seed is not None else torch.seed())

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> probabilities [V] (float32) after every filter; zero outside the kept set."""
        p = self.params
        logits = logits.float()
        keep = torch.ones_like(logits, dtype=torch.bool)
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = logits.topk(p.top_k).values[-1]
            keep &= logits >= kth
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            before = sorted_p.cumsum(0) - sorted_p          # mass strictly before each token
            cut = before >= p.top_p                          # keep the smallest prefix reaching top_p
            cut[0] = False   # the top token always stays: a top_p below float32's range (1e-46) rounds to 0
            drop = torch.zeros_like(keep)
            drop[order] = cut
            keep &= ~drop
        if p.min_p > 0.0:
            keep &= probs >= p.min_p * probs.max()          # the top token passes for every min_p <= 1
        # Shifted so the best kept logit is 0: dividing by a tiny temperature then sends the
        # others towards -inf, never the best one to inf (inf - inf would be NaN).
        shifted = logits - logits.masked_fill(~keep, float("-inf")).max()
        scaled = shifted / max(p.temperature, _MIN_TEMPERATURE)
        return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)

    def sample(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(self.distribution(logits.cpu()), 1, generator=self.gen))

    def draw(self, probs: torch.Tensor) -> int:
        """One token from an explicit distribution (used by speculative sampling). The
        generator lives on the CPU (one seeded stream whatever the device), so the draw does too."""
        return int(torch.multinomial(probs.cpu(), 1, generator=self.gen))

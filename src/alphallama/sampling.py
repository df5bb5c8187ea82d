"""Sampling: greedy, or temperature with top-k / top-p / min-p, seeded.

`Sampler.distribution` gives the final probability vector a token is drawn from, so
speculative sampling can accept/reject against exactly the distribution plain
sampling uses. Filter order follows llama.cpp's default chain: (logit bias, penalties:
penalties.py, applied by the engine to each verify row before the sampler sees it)
top-k, top-p, min-p, then temperature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import DEFAULTS

# Temperatures below this sample as this: float32 logits divided by less overflow, and
# the distribution is already one-hot to float32 precision long before.
_MIN_TEMPERATURE = 1e-6
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 0.01, 100.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULTS.sampling.temperature
    top_k: int = DEFAULTS.sampling.top_k
    top_p: float = DEFAULTS.sampling.top_p
    min_p: float = DEFAULTS.sampling.min_p
    seed: int | None = DEFAULTS.sampling.seed
    # llama.cpp's logit-bias and penalties samplers (penalties.py has the math)
    repeat_penalty: float = DEFAULTS.sampling.repeat_penalty
    repeat_last_n: int = DEFAULTS.sampling.repeat_last_n
    presence_penalty: float = DEFAULTS.sampling.presence_penalty
    frequency_penalty: float = DEFAULTS.sampling.frequency_penalty
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias) pairs; -inf: never

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the penalties change anything (llama.cpp's test: a window and a penalty)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    def validate(self, n_vocab: int | None = None) -> None:
        """Every field's range; with n_vocab, logit_bias's ids too (validate_penalties)."""
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.validate_penalties(n_vocab)

    def validate_penalties(self, n_vocab: int | None = None) -> None:
        """The penalties' and logit_bias's ranges; with n_vocab, the biased ids too."""
        if not MIN_REPEAT_PENALTY <= self.repeat_penalty <= MAX_REPEAT_PENALTY:   # (float32 logits stay finite)
            raise ValueError(f"repeat_penalty must be in [{MIN_REPEAT_PENALTY}, {MAX_REPEAT_PENALTY}] (1 = off), "
                             f"got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (0 = off, -1 = the context), got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for tid, bias in self.logit_bias:
            if tid < 0 or (n_vocab is not None and tid >= n_vocab):
                raise ValueError(f"logit_bias: token id {tid} is outside the vocabulary"
                                 + (f" (0..{n_vocab - 1})" if n_vocab is not None else ""))
            if not (-100.0 <= bias <= 100.0 or bias == -math.inf):
                raise ValueError(f"logit_bias: the bias of token {tid} must be in [-100, 100], got {bias}")


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
        keep = logits > float("-inf")   # a -inf logit (a grammar's mask, a false logit_bias) is never drawn:
        #                                kept, a huge temperature would make it -inf / inf = NaN
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

"""One request's output record: its tokens, finish reason, timings and speculation stats
(Engine.generate and Engine.stream fill it)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .spec.stats import SpecStats


@dataclass
class GenStats:
    prompt_n: int = 0          # prompt rows actually computed (after prefix re-use)
    prompt_reused: int = 0     # prompt rows taken from the cache
    prompt_ms: float = 0.0
    predicted_n: int = 0       # generated tokens
    predicted_ms: float = 0.0  # decode time, from the end of prefill to the last token
    rounds: int = 0            # forward passes after prefill that committed tokens
    draft_n: int = 0
    draft_n_accepted: int = 0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def timings(self) -> dict:
        """llama-server's `timings` object, plus rounds."""
        return {
            "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
            "prompt_per_second": 1000.0 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_second": self.predicted_per_second,
            "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
            "rounds": self.rounds, "cache_n": self.prompt_reused,
        }


@dataclass
class Generation:
    """One request's output; iterate it for token ids as they are committed."""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "stop" (end-of-generation token) | "length"
    stats: GenStats = field(default_factory=GenStats)
    spec: SpecStats = field(default_factory=SpecStats)
    # with logprobs=k: per generated token (its log-prob, [(id, log-prob)] of the k most likely)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


def _logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    lp = torch.log_softmax(logits.float(), -1)     # [V]
    top = lp.topk(k) if k > 0 else None
    pairs = [] if top is None else zip(top.indices.tolist(), top.values.tolist())
    return float(lp[token]), [(t, v) for t, v in pairs if v != float("-inf")]   # a grammar's masked tokens

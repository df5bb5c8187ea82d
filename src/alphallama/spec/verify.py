"""Deciding a round from its verify logits.

Row i of the verify pass holds the model's distribution for the token after row i's
input, so draft i+1 is checked against row i. Greedy: accept while the draft equals the
row's argmax, then add the argmax of the first disagreeing (or last) row as the bonus.
Sampling: the speculative-sampling rule, which keeps the output distribution equal to
plain sampling; with a deterministic drafter (q = one-hot on the draft) it reduces to
"accept draft x with probability p(x), else draw from p with x removed".
"""
from __future__ import annotations

import torch

from ..sampling import Sampler


def greedy_accept(drafts: list[int], logits: torch.Tensor) -> list[int]:
    """logits [1 + len(drafts), V] -> committed tokens (accepted drafts + bonus)."""
    best = logits.argmax(-1).tolist()    # the round's one host sync
    out = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def speculative_sample(drafts: list[int], logits: torch.Tensor, sampler: Sampler,
                       draft_probs: torch.Tensor | None = None) -> list[int]:
    """Committed tokens under sampling. draft_probs [len(drafts), V] is the drafter's
    distribution for each draft (None: the drafter is deterministic, q = one-hot)."""
    out = []
    for i, d in enumerate(drafts):
        p = sampler.distribution(logits[i])                                  # [V]
        q = draft_probs[i] if draft_probs is not None else None
        ratio = p[d] if q is None else torch.clamp(p[d] / q[d], max=1.0)
        if torch.rand((), generator=sampler.gen) < ratio:
            out.append(d)
            continue
        residual = p.clone()
        if q is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        # p is concentrated on the rejected draft alone: numerically impossible branch
        out.append(sampler.draw(residual / total) if total > 0 else int(p.argmax()))
        return out
    out.append(sampler.draw(sampler.distribution(logits[len(drafts)])))
    return out

"""Logit bias and repetition penalties: llama.cpp's logit-bias and penalties samplers
(llama-sampling.cpp), applied to a round's rows before the grammar mask and the sampler.

For each row, in llama.cpp's order (float32, as its samplers compute):
    logit[t] += bias[t]                                         every t in logit_bias
and for every token t seen count[t] > 0 times in the row's window (the last
repeat_last_n tokens of prompt + output before that row; -1: all of them; 0: no penalties):
    logit[t]  = logit[t] * repeat_penalty  if logit[t] <= 0  else  logit[t] / repeat_penalty
    logit[t] -= count[t] * frequency_penalty + presence_penalty

The window holds the prompt too, as llama-server feeds every prompt token to its sampler
before the first one is drawn (OpenAI counts the output alone: docs/server.md says why this
server follows llama-server).

Speculation: row i of a verify round predicts the token after the committed ones and
drafts[:i], so its window is that history, exactly as the grammar masks row i under the
state after drafts[:i] (grammar.py). When drafts[:i] are accepted, row i therefore holds the
logits plain decoding would have at that position, and exact mode stays token-identical.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from .sampling import SamplingParams


def _f32(x: float) -> float:
    """x rounded to float32, as llama.cpp keeps its sampling parameters."""
    return float(np.float32(x))


def penalize(logits: torch.Tensor, counts: torch.Tensor, repeat: float, presence: float,
             frequency: float) -> torch.Tensor:
    """logits [M] of tokens seen counts [M] (>= 1) times in their windows -> penalized [M] float32."""
    v = logits.float()
    v = torch.where(v <= 0, v * _f32(repeat), v / _f32(repeat))
    c = counts.to(torch.float32)
    return v - (c * _f32(frequency) + (c > 0).to(torch.float32) * _f32(presence))


class Penalties:
    """One request's logit bias and penalty window. `commit` each emitted token; `rows`
    leaves the state as it found it."""

    def __init__(self, params: SamplingParams, prompt: list[int], n_vocab: int):
        """n_vocab: the logits' width (logit_bias ids must be below it: ValueError)."""
        params.validate_penalties(n_vocab)
        self.params = params
        self.n = None if params.repeat_last_n == -1 else params.repeat_last_n   # the window; None: all
        self.window: collections.deque[int] = collections.deque()   # the committed window (n tokens at most)
        self.counts: collections.Counter[int] = collections.Counter()   # its tokens' counts
        merged: dict[int, float] = {}
        for tid, bias in params.logit_bias:          # one id given twice: both add, as llama.cpp's
            merged[tid] = merged.get(tid, 0.0) + bias
        self._bias_ids = torch.tensor(list(merged), dtype=torch.int64)             # [B]
        self._bias = torch.tensor(list(merged.values()), dtype=torch.float32)      # [B]
        if params.penalized:
            for t in prompt[-self.n:] if self.n is not None else prompt:
                self.commit(t)

    @classmethod
    def start(cls, params: SamplingParams, prompt: list[int], n_vocab: int) -> "Penalties | None":
        """The request's Penalties, or None when neither a bias nor a penalty is set."""
        if not params.logit_bias and not params.penalized:
            return None
        return cls(params, prompt, n_vocab)

    def commit(self, token: int) -> None:
        """One more token of the history (prompt or output)."""
        if not self.params.penalized:
            return
        self.counts[token] += 1
        if self.n is None:                   # the whole history: nothing leaves (the window is not kept)
            return
        self.window.append(token)
        if len(self.window) > self.n:
            old = self.window.popleft()
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]

    def rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [1 + len(drafts), V] -> a biased and penalized copy: row i with the window
        after the committed tokens and drafts[:i]."""
        assert logits.shape[0] == len(drafts) + 1, (logits.shape, len(drafts))
        out = logits.clone()                 # (the GPU's logits are a graph's static buffer)
        if self._bias_ids.numel():
            if self._bias_ids.device != out.device:     # moved once: the same device every round
                self._bias_ids, self._bias = self._bias_ids.to(out.device), self._bias.to(out.device)
            ids = self._bias_ids
            out[:, ids] = (out[:, ids].float() + self._bias).to(out.dtype)
        if self.params.penalized:
            row, tok, cnt = self.seen(drafts).to(out.device)       # [M] each
            p = self.params
            out[row, tok] = penalize(out[row, tok], cnt, p.repeat_penalty, p.presence_penalty,
                                     p.frequency_penalty).to(out.dtype)
        return out

    def seen(self, drafts: list[int]) -> torch.Tensor:
        """[3, M] int64: (row, token, count) for every token each row's window holds."""
        w = len(drafts) + 1
        uniq = list(dict.fromkeys([*self.counts, *drafts]))          # [U] every token any row can see
        col = {t: j for j, t in enumerate(uniq)}
        base = torch.tensor([self.counts.get(t, 0) for t in uniq], dtype=torch.int64)   # [U] row 0
        delta = torch.zeros(w, len(uniq), dtype=torch.int64)                             # [W, U]
        moves = self._moves(drafts)
        if moves:
            r, t, sign = zip(*moves)
            delta.index_put_((torch.tensor(r), torch.tensor([col[x] for x in t])), torch.tensor(sign),
                             accumulate=True)
        counts = base[None] + delta.cumsum(0)                                            # [W, U]
        r, c = counts.nonzero(as_tuple=True)
        return torch.stack([r, torch.tensor(uniq, dtype=torch.int64)[c], counts[r, c]])

    def _moves(self, drafts: list[int]) -> list[tuple[int, int, int]]:
        """The window's changes from row i to row i + 1: drafts[i] enters and, with a full
        window, its oldest token leaves. -> [(row, token, +1 / -1)]."""
        seq = [*self.window, *drafts]      # (n None: the window is not kept, nothing leaves)
        m = len(self.window)
        moves = []
        for i, d in enumerate(drafts):
            moves.append((i + 1, d, 1))
            if self.n is not None and m + i + 1 > self.n:   # row i + 1's window starts one later
                moves.append((i + 1, seq[m + i - self.n], -1))
        return moves


def shape_rows(logits: torch.Tensor, drafts: list[int], penalties: Penalties | None, constraint) -> torch.Tensor:
    """A round's logits [1 + len(drafts), V] as the sampler sees them: biased and penalized,
    then masked by the grammar (a grammar.TokenConstraint or None), row i after drafts[:i]."""
    if penalties is not None:
        logits = penalties.rows(logits, drafts)
    if constraint is not None:
        logits = constraint.mask_rows(logits, drafts)
    return logits

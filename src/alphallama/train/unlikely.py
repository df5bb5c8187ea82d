"""Sequence-level unlikelihood (Welleck et al., 2019, "Neural text degeneration with
unlikelihood training"): the model continues prefixes greedily, as a user's plain
`alphallama run` does; the tokens of its continuation inside an n-gram it already wrote in
that continuation (more often than the prefix holds it) are where it loops, and
-log(1 - p(token)) at each of them is the loss. Added to the usual cross-entropy it unlearns
the loop without a penalty at decode time.

    cfg = Unlikely(weight=..., every=..., batch=..., prefix=..., new=..., ngram=...)
    pre = prefixes(tokens, doc_starts, cfg.batch, cfg.prefix, g)       # [B, P]
    seq = rollout(model, pre, cfg.new, device)                          # [B, P + new]
    mask = repeated(seq, cfg.prefix, cfg.ngram, stop_ids)               # [B, P + new] bool
    loss, share = unlikelihood_loss(model, seq, mask, device, cfg.prefix)
    term = LoopTerm(cfg, train_tokens, eot, stop_ids, seed);  loss, share = term(model, step, device)

The n-gram is in tokens and long (8) on purpose: code repeats short spans legitimately
(`self.`, an indentation and a keyword); a loop repeats lines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import MoEModel, autocast


@dataclass(frozen=True)
class Unlikely:
    weight: float = 0.0     # loss = CE + weight * unlikelihood (0: off)
    every: int = 2          # an unlikelihood term every this many steps
    batch: int = 128        # rollouts a term
    prefix: int = 64        # tokens of each rollout's prefix
    new: int = 128          # greedy tokens each rollout adds
    ngram: int = 8          # a continuation token is a loop's when it completes a repeated n-gram


def prefixes(tokens: torch.Tensor, doc_starts: torch.Tensor, batch: int, P: int,
             g: torch.Generator) -> torch.Tensor:
    """[B, P] int64 windows of the token stream: half at documents' first tokens (a file's
    imports, a chat's system prompt: where the held-out continuations start), half anywhere."""
    n_doc = batch // 2 if len(doc_starts) else 0
    docs = doc_starts[torch.randint(0, len(doc_starts), (n_doc,), generator=g)] if n_doc else doc_starts[:0]
    anywhere = torch.randint(0, len(tokens) - P, (batch - n_doc,), generator=g)
    starts = torch.cat([docs.clamp(max=len(tokens) - P), anywhere])                  # [B]
    return tokens[starts[:, None] + torch.arange(P)[None, :]].to(torch.int64)        # [B, P]


@torch.no_grad()
def rollout(model: MoEModel, prefix: torch.Tensor, new: int, device: str) -> torch.Tensor:
    """Greedy continuation of each row, `new` tokens, one token a step on the module's
    (k, v) cache."""
    was = model.training
    model.eval()
    seq = prefix.to(device)                                                          # [B, P]
    cache: list = []
    with autocast(device):
        hidden, _ = model(seq, cache)                                                # [B, P, D]
        for i in range(new):
            nxt = model.logits(hidden[:, -1:]).argmax(-1)                             # [B, 1]
            seq = torch.cat([seq, nxt], dim=1)
            if i + 1 < new:
                hidden, _ = model(nxt, cache)                                        # [B, 1, D]
    model.train(was)
    return seq                                                                       # [B, P + new]


def repeated(seq: torch.Tensor, start: int, n: int, stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, L] bool: continuation tokens (positions >= start) inside a loop's n-gram, up to
    the row's first stop token (what follows it is not text a user sees). An n-gram of the
    continuation is a loop's when the continuation already wrote it at least max(1, p) times,
    p its count in the prefix: copying from the context is what an edit or a call to a
    function defined above does, and a log or CSV copied line by line repeats its lines as
    often as the prefix does; a loop is the model repeating itself beyond that."""
    B, L = seq.shape
    grams = seq.unfold(1, n, 1)                                                      # [B, G, n], G = L-n+1
    G = grams.shape[1]
    same = (grams[:, :, None, :] == grams[:, None, :, :]).all(-1)                   # [B, G, G]
    first = torch.arange(G, device=seq.device)                                       # first position of gram j
    earlier = torch.ones(G, G, dtype=torch.bool, device=seq.device).tril(-1)          # [i, j]: j < i
    earlier &= (first >= start)[None, :]                                             # gram j in the continuation
    written = (same & earlier).sum(-1)                                               # [B, G] times i was written before
    in_prefix = (same & (first + n <= start)[None, :]).sum(-1)                       # [B, G] times i is in the prefix
    again = written >= in_prefix.clamp(min=1)
    mask = torch.zeros(B, L, dtype=torch.bool, device=seq.device)
    for k in range(n):      # every token of a repeated gram (gram i > gram j >= start: no prefix token)
        mask[:, k:k + G] |= again
    if stop_ids:
        stop = torch.isin(seq, torch.tensor(stop_ids, device=seq.device))
        stop[:, :start] = False
        after = stop.cumsum(1) > 0                                                   # the stop token and beyond
        mask &= ~after
    return mask


def unlikelihood_loss(model: MoEModel, seq: torch.Tensor, mask: torch.Tensor, device: str,
                      start: int) -> tuple[torch.Tensor, float]:
    """(mean over the continuation's positions of -log(1 - p(seq_t | seq_<t)) at the masked
    ones, share of continuation positions masked). Logits only at the masked positions."""
    seq, mask = seq.to(device), mask.to(device)
    n_cont = seq.shape[0] * (seq.shape[1] - start)
    tgt_mask = mask[:, 1:]                                                           # [B, L-1] target t+1
    if not bool(tgt_mask.any()):
        return seq.new_zeros((), dtype=torch.float32), 0.0
    with autocast(device):
        hidden, _ = model(seq[:, :-1])                                               # [B, L-1, D]
        h = model.normed(hidden[tgt_mask])                                           # [M, D]
        logp = F.log_softmax(F.linear(h, model.embed).float(), dim=-1)               # [M, V]
    lp = logp.gather(1, seq[:, 1:][tgt_mask][:, None]).squeeze(1)                    # [M]
    one_minus = (-torch.expm1(lp)).clamp(min=1e-5)                                   # 1 - p, stable near p = 1
    loss = -torch.log(one_minus).sum() / n_cont
    return loss, int(tgt_mask.sum()) / n_cont


class LoopTerm:
    """The unlikelihood term of a training step: prefixes drawn from (seed, step) alone."""

    def __init__(self, cfg: Unlikely, tokens: torch.Tensor, eot: int, stop_ids: tuple[int, ...], seed: int):
        self.cfg, self.tokens, self.stop_ids, self.seed = cfg, tokens, tuple(stop_ids), seed
        starts = (tokens == eot).nonzero().flatten() + 1
        self.doc_starts = starts[starts < len(tokens)]                                  # [n_docs]

    def due(self, step: int) -> bool:
        return self.cfg.weight > 0 and step % self.cfg.every == 0

    def __call__(self, model: MoEModel, step: int, device: str) -> tuple[torch.Tensor, float]:
        c = self.cfg
        g = torch.Generator().manual_seed(self.seed * 7_000_003 + step)
        seq = rollout(model, prefixes(self.tokens, self.doc_starts, c.batch, c.prefix, g), c.new, device)
        mask = repeated(seq, c.prefix, c.ngram, self.stop_ids)
        return unlikelihood_loss(model, seq, mask, device, c.prefix)

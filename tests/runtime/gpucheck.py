"""The GPU runtime's two checks on a model, shared by the runtime tests: its logits follow the
reference transformer's, and a round's rows equal the same rows run one at a time."""
from __future__ import annotations

import pytest
import torch

TOL = 4e-2   # of the largest logit: fp16 K/V, fp16 attention inputs and int8 activations
             # (one scale per 32 values, as llama.cpp's q8_1) against an fp32 reference
NEAR_TIE = 0.05   # of a row's largest |router logit|: a k-th / (k+1)-th gap under it may route the
                  # other way from bf16 rows (H100: flips seen at 0.04% and at 3.5%)


def router_gaps(ref, toks: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's logits of toks from position 0 [T, V], and per row the smallest gap, over
    the MoE layers, between its k-th and (k+1)-th router logit (router bias included) over the
    row's largest |router logit| [T] (inf without experts). A GPU row at a near-tie may take the
    other expert: the prefill comparisons leave such rows out."""
    gaps, k, ffn = torch.full((toks.shape[0],), float("inf")), ref.cfg.n_experts_used, ref._ffn

    def recording(i: int, h: torch.Tensor) -> torch.Tensor:
        lg = h @ ref.w[f"blk.{i}.ffn_gate_inp.weight"].T                       # [T, E]
        bias = ref.w.get(f"blk.{i}.ffn_gate_inp.bias")
        lg = lg if bias is None else lg + bias
        top = lg.topk(k + 1, dim=-1).values
        torch.minimum(gaps, (top[:, k - 1] - top[:, k]) / lg.abs().amax(-1), out=gaps)
        return ffn(i, h)
    if ref.cfg.is_moe:
        ref._ffn = recording
    try:
        lr, _ = ref.forward(toks, 0, ref.new_cache(ctx))
    finally:
        ref._ffn = ffn
    return lr, gaps


def follows_reference(ref, gpu, toks: torch.Tensor, ctx: int, alone_from: int, steps: int = 0) -> torch.Tensor:
    """gpu's logits for toks within TOL of ref's, and rows alone_from.. run one at a time equal
    the round's, bit for bit; then `steps` greedy steps (the reference's pick fed to both),
    each step's logits within TOL. Returns ref's logits [T, V] (of toks)."""
    rc = ref.new_cache(ctx)
    lr, _ = ref.forward(toks, 0, rc)
    cache = gpu.new_cache(ctx)
    lg = gpu.forward(toks, 0, cache)[0].clone()                   # graph outputs are static buffers
    torch.testing.assert_close(lg.cpu(), lr, atol=TOL * lr.abs().max().item(), rtol=0)
    cache.truncate(alone_from)
    singles = torch.cat([gpu.forward(toks[i:i + 1], i, cache)[0].clone() for i in range(alone_from, len(toks))])
    assert torch.equal(singles, lg[alone_from:])
    last = lr[-1:]
    for p in range(len(toks), len(toks) + steps):
        nxt = last.argmax(-1)                                     # [1] the reference's greedy token
        last = ref.forward(nxt, p, rc)[0]
        step = gpu.forward(nxt, p, cache)[0].cpu()
        torch.testing.assert_close(step, last, atol=TOL * last.abs().max().item(), rtol=0)
    return lr


def _chain(head, g: torch.Tensor, toks: torch.Tensor, depth: int, ctx: int):
    """3 rows staged by extend, then a chain of `depth` drafts from the rest -> (tokens, probs)."""
    cache = head.new_cache(ctx)
    head.extend(g[:3], toks[:3], 0, cache)
    out = head.draft(g[3:], toks[3:], 3, depth, cache)
    assert cache.length == len(toks)
    return out


def chains_follow(rhead, ghead, g: torch.Tensor, toks: torch.Tensor, depth: int, vocab: int, ctx: int,
                  dev: str) -> None:
    """An MTP head's chain of `depth` drafts gives the reference head's tokens, their probabilities
    within 2e-3; then over a draft vocabulary (the odd ids) a chain of depth - 1 does too."""
    want, want_p = _chain(rhead, g, toks, depth, ctx)
    got, got_p = _chain(ghead, g.to(dev), toks, depth, ctx)
    assert got == want
    assert got_p == pytest.approx(want_p, abs=2e-3)
    ids = torch.arange(1, vocab, 2)
    rhead.set_vocab(ids)
    ghead.set_vocab(ids)
    try:
        want, want_p = _chain(rhead, g, toks, depth - 1, ctx)
        got, got_p = _chain(ghead, g.to(dev), toks, depth - 1, ctx)
    finally:
        rhead.set_vocab(None)
        ghead.set_vocab(None)
    assert got == want and all(t % 2 == 1 for t in got)
    assert got_p == pytest.approx(want_p, abs=2e-3)
    assert ghead.use_graphs == (dev == "cuda")


def slots_follow_alone(head, g: torch.Tensor, toks: torch.Tensor, cuts: list[tuple[int, int, int]], depth: int,
                       ctx: int, dev: str) -> None:
    """An MTP head's slots (new_caches: one cache, the row table) keep each stream's entries and
    chains its own. Stream i is rows cuts[i] = (start, a, b) .. of g [n, D] / toks [n], re-positioned
    from 0: entries of its first a rows, then a chain of `depth` after rows a..b-1 are staged, another
    after b..; run alone on a one-slot cache (the scalar form), then in slots of one cache with the
    streams' steps interleaved (the last stream first): every chain (tokens and probabilities) and
    every slot's entries (K/V) are the alone ones, bit for bit."""
    ends = [c[0] for c in cuts[1:]] + [len(toks)]

    def step(cache, i: int, k: int):
        start, a, b = cuts[i]
        lo, hi = ((0, a), (a, b), (b, ends[i] - start))[k]
        rows, tk = g[start + lo:start + hi].to(dev), toks[start + lo:start + hi]
        if k == 0:
            return head.extend(rows, tk, lo, cache)
        return head.draft(rows, tk, lo, depth, cache)

    def entries(cache) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.k[0, :, :cache.length].clone(), cache.v[0, :, :cache.length].clone()
    alone = []
    for i in range(len(cuts)):
        cache = head.new_cache(ctx)
        alone.append(([step(cache, i, k) for k in range(3)], entries(cache)))
    slots = head.new_caches(ctx, len(cuts))
    got: list[list] = [[None] * 3 for _ in cuts]
    for k in range(3):
        for i in reversed(range(len(cuts))):
            got[i][k] = step(slots[i], i, k)
    for i, s in enumerate(slots):
        assert got[i][1:] == alone[i][0][1:], i
        assert all(torch.equal(x, y) for x, y in zip(entries(s), alone[i][1])), i
    head.new_cache(ctx)                      # the head back on a one-slot cache, as the other tests have it

"""The GPU runtime's two checks on a model, shared by the runtime tests: its logits follow the
reference transformer's, and a round's rows equal the same rows run one at a time."""
from __future__ import annotations

import torch

TOL = 4e-2   # of the largest logit: fp16 K/V, fp16 attention inputs and int8 activations
             # (one scale per 32 values, as llama.cpp's q8_1) against an fp32 reference


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

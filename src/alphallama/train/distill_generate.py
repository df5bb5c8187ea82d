"""The teacher answers chat requests itself (greedy, batched): the model's own outputs
are what its MTP head will draft, so they are the best distillation data, and
teacher-forced on them the head's top-1 agreement per depth is the exact-mode
acceptance it will see (up to the bf16 teacher's near-ties).

Prompts of similar length are batched, left-padded, and decoded with a `BatchCache`
(distill_teacher.py); generation stops at a deadline between batches.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import torch

from .distill_teacher import Teacher


@torch.no_grad()
def generate_batch(teacher: Teacher, prompts: Sequence[Sequence[int]], max_new: int,
                   stop_ids: Sequence[int], pad_id: int = 0, prefill_chunk: int = 512) -> list[list[int]]:
    """Greedy continuations of `prompts` (one batch), each cut after its first stop
    token (kept) or at max_new tokens."""
    dev = teacher.device
    B, P = len(prompts), max(len(p) for p in prompts)
    cache = teacher.new_cache(B, P + max_new)
    toks = torch.full((B, P), pad_id, dtype=torch.int64)
    for r, p in enumerate(prompts):
        toks[r, P - len(p):] = torch.tensor(p, dtype=torch.int64)
        cache.valid[r, P - len(p):] = True
    cache.valid[:, P:] = True
    stops = torch.tensor(list(stop_ids), dtype=torch.int64, device=dev)
    toks = toks.to(dev)
    for s in range(0, P, prefill_chunk):   # chunks bound the [B, group*chunk, L] attention mask
        h = teacher.forward(toks[:, s:s + prefill_chunk], cache, s)           # [B, chunk, D]
    nxt = teacher.logits(h[:, -1]).argmax(-1)                                  # [B]
    done = torch.isin(nxt, stops)
    out = [nxt]
    for t in range(1, max_new):
        if t % 8 == 0 and bool(done.all()):   # a host sync every 8 steps, not every step
            break
        h = teacher.forward(nxt[:, None], cache, P + t - 1)                   # [B, 1, D]
        nxt = torch.where(done, stops[0], teacher.logits(h[:, -1]).argmax(-1))
        done |= torch.isin(nxt, stops)
        out.append(nxt)
    gen = torch.stack(out, 1).cpu().tolist()                                   # [B, n]
    stop_set = set(stop_ids)
    res = []
    for row in gen:
        cut = next((i + 1 for i, x in enumerate(row) if x in stop_set), len(row))
        res.append(row[:cut])
    return res


def generate_all(teacher: Teacher, prompts: Sequence[Sequence[int]], max_new: int,
                 stop_ids: Sequence[int], deadline: float, max_batch: int = 128,
                 batch_tokens: int = 1 << 18, seed: int = 0, log=print,
                 stop: Callable[[], bool] | None = None) -> list[list[int] | None]:
    """Answers for as many prompts as the deadline (time.monotonic()) allows, or until
    stop() says so between batches; None for prompts not reached. Batches hold prompts of
    similar length (little padding) and run in a shuffled order, so a deadline does not
    favour short requests."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches, i = [], 0
    while i < len(order):
        longest = len(prompts[order[min(len(order), i + max_batch) - 1]])
        B = max(1, min(max_batch, batch_tokens // (longest + max_new)))
        batches.append(order[i:i + B])
        i += B
    random.Random(seed).shuffle(batches)
    out: list[list[int] | None] = [None] * len(prompts)
    n_req, n_tok, t0 = 0, 0, time.monotonic()
    for idx in batches:
        if time.monotonic() >= deadline or (stop is not None and stop()):
            break
        for j, ans in zip(idx, generate_batch(teacher, [prompts[j] for j in idx], max_new, stop_ids)):
            out[j] = ans
            n_tok += len(ans)
        n_req += len(idx)
        log(f"generate: {n_req}/{len(order)} requests answered, {n_tok} tokens, "
            f"{n_tok / max(1e-9, time.monotonic() - t0):.0f} tok/s")
    return out

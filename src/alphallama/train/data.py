"""Training data: the corpus files plus rendered instruction examples, tokenized into one
stream of uint16 ids (documents separated by <|endoftext|>), and batches of random
windows from it that are a function of (seed, step) alone, so a resumed run continues
with the batches it would have drawn.
"""
from __future__ import annotations

import multiprocessing as mp
import random
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from .instruct import SYSTEM_PROMPTS, make_examples, make_template, render, teacher_edit

# The texts the example workers draw from. Set just before the pool forks, so workers
# inherit them instead of receiving 100+ MB through pickling; cleared afterwards.
_FORK_TEXTS: list[str] = []


def _examples_worker(args: tuple) -> list[tuple[str, str]]:
    """Worker i of `of` draws from every of-th text only, so the workers' code-writing
    requests (each worker's functions in turn) never ask for the same function twice;
    likewise every of-th teacher answer."""
    n, seed, max_chars, i, of, weights, teacher, asked, share = args
    tmpl = make_template()
    rng = random.Random(seed)
    teacher = [teacher_edit(q, a) for q, a in teacher]
    out = []
    for e in make_examples(_FORK_TEXTS[i::of], n, seed=seed, max_chars=max_chars, weights=dict(weights),
                           teacher=teacher, teacher_share=share, teacher_asked=asked):
        system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.3 else None
        out.append((e.kind, render(e, tmpl, system)))
    return out


def rendered_examples(texts: list[str], n: int, seed: int, max_chars: int = 1400,
                      workers: int = 1, weights: dict[str, int] | None = None,
                      teacher: list[tuple[str, str]] | None = None,
                      teacher_share: float | None = None) -> list[tuple[str, str]]:
    """n (kind, ChatML text) examples made from `texts`, in `workers` processes; kinds
    weighted as make_examples does. teacher: (request, answer) pairs (teach_answers.py)
    that answer code-writing requests, at `teacher_share` of them (None: all of them
    first, instruct.TeacherMix); rendered with the student's template like the rest."""
    global _FORK_TEXTS
    per = max(1, -(-n // max(workers, 1)))
    w = tuple(sorted((weights or {}).items()))
    k = -(-n // per)                                   # workers that get examples
    teacher = list(teacher or [])
    asked = frozenset(q for q, _ in teacher)
    jobs = [(min(per, n - i * per), seed * 1000 + i, max_chars, i, k, w, teacher[i::k], asked, teacher_share)
            for i in range(k)]
    _FORK_TEXTS = texts
    try:
        if workers <= 1 or mp.get_start_method(allow_none=True) not in (None, "fork"):
            parts = [_examples_worker(j) for j in jobs]
        else:
            with ProcessPoolExecutor(len(jobs), mp_context=mp.get_context("fork")) as pool:
                parts = list(pool.map(_examples_worker, jobs))
    finally:
        _FORK_TEXTS = []
    return [x for p in parts for x in p]


def tokenize_docs(hf, docs: list[str], eot: int, batch: int = 2048) -> np.ndarray:
    """All documents, each followed by eot, as one uint16 array."""
    if hf.get_vocab_size() > 65535:
        raise ValueError("the vocabulary does not fit uint16 token ids")
    out = []
    for i in range(0, len(docs), batch):
        for enc in hf.encode_batch(docs[i:i + batch], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.uint16))
            out.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint16)


def get_batch(tokens: torch.Tensor, batch_size: int, T: int, seed: int, step: int,
              device: str | torch.device) -> torch.Tensor:
    """[B, T+1] int64 windows at random offsets, drawn from (seed, step) alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - T - 1, (batch_size,), generator=g)     # [B]
    idx = starts[:, None] + torch.arange(T + 1)[None, :]                            # [B, T+1]
    return tokens[idx].to(torch.int64).to(device, non_blocking=True)


def val_batch(tokens: torch.Tensor, n: int, T: int, device) -> torch.Tensor:
    """n consecutive windows from the start of the held-out stream (the same every time)."""
    n = max(1, min(n, (len(tokens) - 1) // (T + 1)))
    return tokens[:n * (T + 1)].view(n, T + 1).to(torch.int64).to(device)

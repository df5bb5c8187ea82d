"""Token data for MTP distillation: corpus files and chat requests, tokenized with the
model's own tokenizer (in worker processes: ~0.6M tokens/s per core), packed into
fixed-length rows and drawn in fixed proportions. (Files are held out by content hash
in train/corpus.py.)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
from typing import Iterable, Iterator, Sequence

import torch

from ..chat import ChatTemplate, chat_prompt_ids
from ..gguf.reader import GGUFFile
from ..tokenizer import Tokenizer


class ChatEncoder:
    """The model's tokenizer and chat template: user text -> prompt ids, answers -> ids."""

    def __init__(self, model_path: str):
        md = GGUFFile(model_path).metadata
        self.tok = Tokenizer.from_metadata(md)
        self.template = ChatTemplate.from_gguf_metadata(md)
        end = self.tok.id_of("<|im_end|>")
        self.end_id = end if end is not None else self.tok.eos_id
        # documents are joined by end-of-text, as the model saw files end in pre-training
        sep = self.tok.id_of("<|endoftext|>")
        self.sep_id = sep if sep is not None else (self.tok.eos_id if self.tok.eos_id is not None else 0)

    def prompt(self, user: str, system: str | None = None) -> list[int]:
        msgs = [{"role": "system", "content": system}] if system else []
        return chat_prompt_ids(self.template, self.tok, msgs + [{"role": "user", "content": user}])

    def answer(self, text: str) -> list[int]:
        return self.tok.encode(text) + [self.end_id]


_WORKER: ChatEncoder | None = None


def _init_worker(model_path: str) -> None:
    global _WORKER   # one encoder per worker process, built once
    _WORKER = ChatEncoder(model_path)


def _encode_task(task: tuple) -> list[int] | tuple[list[int], list[int]]:
    kind, *args = task
    if kind == "text":
        return _WORKER.tok.encode(args[0])
    user, answer, *system = args
    return _WORKER.prompt(user, *system), (_WORKER.answer(answer) if answer is not None else [])


def encode_parallel(model_path: str, tasks: Iterable[tuple], workers: int) -> Iterator:
    """Encode ("text", s) or ("chat", user, answer|None[, system]) tasks in order, in
    `workers` processes (0: in this process). Yields ids, or (prompt ids, answer ids)."""
    if workers <= 0:
        _init_worker(model_path)
        yield from map(_encode_task, tasks)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(workers, initializer=_init_worker, initargs=(model_path,)) as pool:
        yield from pool.imap(_encode_task, tasks, chunksize=16)


def tokenize_texts(model_path: str, texts: Sequence[str], max_tokens: int, workers: int,
                   max_doc_tokens: int = 32768) -> list[list[int]]:
    """Token ids of texts in order until max_tokens are collected; each document is cut
    at max_doc_tokens (one huge generated file must not fill the budget)."""
    out, total = [], 0
    it = encode_parallel(model_path, (("text", t) for t in texts), workers)
    for ids in it:
        ids = ids[:max_doc_tokens]
        out.append(ids)
        total += len(ids)
        if total >= max_tokens:
            if hasattr(it, "close"):
                it.close()
            break
    return out


def pack(seqs: Sequence[Sequence[int]], T: int, sep: int, seed: int = 0) -> torch.Tensor:
    """Documents in a shuffled order, joined by `sep`, cut into rows: int64 [N, T]."""
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    flat: list[int] = []
    for i in order:
        flat.extend(seqs[i])
        flat.append(sep)
    n = len(flat) // T
    if n == 0:
        raise ValueError(f"{len(flat)} tokens of data do not fill one row of {T}")
    return torch.tensor(flat[:n * T], dtype=torch.int64).view(n, T)


class RowSampler:
    """Batches of rows drawn from several packed sources in fixed proportions, each
    source in reshuffled epochs."""

    def __init__(self, sources: dict[str, torch.Tensor], shares: dict[str, float], seed: int = 0):
        self.sources = {k: v for k, v in sources.items() if v.shape[0] > 0 and shares.get(k, 0) > 0}
        if not self.sources:
            raise ValueError("no training rows: every data source is empty")
        total = sum(shares[k] for k in self.sources)
        self.shares = {k: shares[k] / total for k in self.sources}
        self.gen = torch.Generator().manual_seed(seed)
        self.perm = {k: torch.randperm(v.shape[0], generator=self.gen) for k, v in self.sources.items()}
        self.pos = dict.fromkeys(self.sources, 0)
        self.epochs = dict.fromkeys(self.sources, 0)

    def _take(self, k: str, n: int) -> torch.Tensor:
        rows = []
        while n > 0:
            if self.pos[k] >= len(self.perm[k]):
                self.perm[k] = torch.randperm(len(self.perm[k]), generator=self.gen)
                self.pos[k] = 0
                self.epochs[k] += 1
            idx = self.perm[k][self.pos[k]:self.pos[k] + n]
            self.pos[k] += len(idx)
            n -= len(idx)
            rows.append(self.sources[k][idx])
        return torch.cat(rows)

    def batch(self, B: int) -> torch.Tensor:
        """[B, T] int64: each source's share of rows (rounded down; the rest from the
        source of the largest share)."""
        counts = {k: int(B * s) for k, s in self.shares.items()}
        counts[max(self.shares, key=self.shares.get)] += B - sum(counts.values())
        return torch.cat([self._take(k, n) for k, n in counts.items() if n > 0])

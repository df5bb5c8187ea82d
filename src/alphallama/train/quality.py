"""Measures of a model's text that do not depend on its tokenizer, so two models with
different vocabularies compare: held-out bits per byte, how much of an output repeats
itself, and whether a chat answer holds a Python function that parses.

    heldout_bits_per_byte(engine, texts, windows)  -> {"bits_per_byte", "bytes", ...}
    repeat_share(text, n=6)                         -> share of n-word windows seen before
    answer_code(text)                               -> the code of a fenced answer
    defines_function(code)                          -> parses and defines a function
"""
from __future__ import annotations

import ast
import math
import re

import torch
import torch.nn.functional as F


def heldout_bits_per_byte(engine, texts: list[str], windows: int) -> dict:
    """Cross-entropy of the first ctx tokens of each of `windows` texts, in bits per
    UTF-8 byte of the predicted tokens (the first token of a window is not predicted).
    Per token it would favour a tokenizer with shorter tokens; per byte it does not."""
    nats, n_bytes, n_tok = 0.0, 0, 0
    for text in texts[:windows]:
        ids = engine.encode_prompt(text)[:engine.ctx_size]
        if len(ids) < 2:
            continue
        engine.reset()
        logits, _ = engine.model.forward(torch.tensor(ids, dtype=torch.int64), 0, engine.cache)   # [T, V]
        tgt = torch.tensor(ids[1:], dtype=torch.int64)
        nats += F.cross_entropy(logits[:-1].float().cpu(), tgt, reduction="sum").item()
        n_bytes += len(engine.tokenizer.decode(ids[1:]).encode())
        n_tok += len(ids) - 1
    engine.reset()
    return {"bits_per_byte": round(nats / math.log(2) / max(1, n_bytes), 4),
            "nats_per_token": round(nats / max(1, n_tok), 4), "windows": min(windows, len(texts)),
            "bytes": n_bytes, "tokens": n_tok, "nats": nats}


def repeat_share(text: str, n: int = 6) -> float:
    """Share of the text's n-word windows that already occurred earlier in it: near 0
    for ordinary code, near 1 for an output that loops."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    seen: set[tuple[str, ...]] = set()
    again = 0
    for g in grams:
        again += g in seen
        seen.add(g)
    return round(again / len(grams), 3) if grams else 0.0


_FENCED = re.compile(r"```(?:python|py)?\n(.*?)(?:\n```|$)", re.DOTALL)


def answer_code(text: str) -> str:
    """The first fenced block of an answer (to its end if the fence is unclosed), else all."""
    m = _FENCED.search(text)
    return m.group(1) if m else text


def defines_function(code: str) -> bool:
    """Does the code parse, with a function definition at its top level?"""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body)

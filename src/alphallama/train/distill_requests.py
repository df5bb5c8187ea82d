"""Chat-shaped code requests built from corpus files, so the distilled MTP head sees the
text it will draft in use: a ChatML prompt and the model's answer (prose, code fences,
whole files copied back with an edit, a few non-English requests).

A request is a user message; some kinds also have a reference answer a program can
write (the function itself, the file with an identifier renamed), used when the teacher
does not generate answers (`--gen-budget-s 0`, the CPU test). With generation the
teacher answers every request itself (distill_generate.py): self-distillation on the
model's own outputs.
"""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Function:
    name: str
    signature: str      # "name(a, b=1)"
    doc: str            # first paragraph of the docstring
    source: str         # the whole def, dedented
    file_text: str      # the file it came from


@dataclass(frozen=True)
class Request:
    kind: str
    user: str
    answer: str | None  # a reference answer, or None (only the teacher can answer)


MAX_FUNC_LINES = 60
MAX_FILE_CHARS = 6000   # whole-file requests: ~1500 tokens of code


def functions_of(text: str, max_lines: int = MAX_FUNC_LINES) -> list[Function]:
    """Documented top-level or method functions of a Python file (unparsable files: none)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None or not 3 <= node.end_lineno - node.lineno < max_lines:
            continue
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
        if not 10 <= len(first) <= 300:
            continue
        body = lines[node.lineno - 1 - len(node.decorator_list):node.end_lineno]
        indent = min(len(s) - len(s.lstrip()) for s in body if s.strip())
        try:
            args = ast.unparse(node.args)
        except Exception:   # noqa: BLE001 - odd syntax trees: skip the function
            continue
        out.append(Function(node.name, f"{node.name}({args})", first,
                            "\n".join(s[indent:] for s in body), text))
    return out


def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:]


def _write(f: Function, rng: random.Random) -> Request:
    return Request("write", f"Write a Python function `{f.signature}` that {_lower_first(f.doc)}",
                   _fence(f.source))


def _explain(f: Function, rng: random.Random) -> Request:
    return Request("explain", f"Explain what this function does:\n\n{_fence(f.source)}", None)


def _tests(f: Function, rng: random.Random) -> Request:
    return Request("tests", f"Write pytest unit tests for this function:\n\n{_fence(f.source)}", None)


def _review(f: Function, rng: random.Random) -> Request:
    return Request("review", f"Review this code: point out bugs or risky parts and suggest "
                             f"fixes.\n\n{_fence(f.source)}", None)


def _rename(f: Function, rng: random.Random) -> Request | None:
    text = f.file_text if len(f.file_text) <= MAX_FILE_CHARS else f.source
    new = rng.choice(["do_", "run_", "compute_", "handle_"]) + f.name.lstrip("_")
    if new == f.name or re.search(rf"\b{re.escape(new)}\b", text):
        return None
    renamed = re.sub(rf"\b{re.escape(f.name)}\b", new, text)
    return Request("rename", f"Rename the function `{f.name}` to `{new}` everywhere in this file. "
                             f"Return the whole file.\n\n{_fence(text)}", _fence(renamed))


# Non-English requests: the model answers in the language asked, so the head sees the
# scripts the drafter must handle (Cyrillic, CJK, Latin with accents).
_FOREIGN = (
    "Напиши функцию на Python `{sig}`, которая делает следующее: {doc}",
    "Объясни, что делает эта функция:\n\n{code}",
    "用 Python 写一个函数 `{sig}`：{doc}",
    "解释一下这个函数的作用：\n\n{code}",
    "Escribe una función de Python `{sig}` que haga lo siguiente: {doc}",
    "Erkläre, was diese Funktion macht:\n\n{code}",
)


def _foreign(f: Function, rng: random.Random) -> Request:
    t = rng.choice(_FOREIGN)
    return Request("foreign", t.format(sig=f.signature, doc=f.doc, code=_fence(f.source)), None)


# kind -> (maker, weight); a maker may return None when the function does not suit it
KINDS: dict[str, tuple[Callable[[Function, random.Random], Request | None], float]] = {
    "write": (_write, 3.0),
    "explain": (_explain, 2.0),
    "tests": (_tests, 1.0),
    "review": (_review, 1.0),
    "rename": (_rename, 2.0),
    "foreign": (_foreign, 1.0),
}


def make_requests(texts: list[str], n: int, seed: int, answered_only: bool = False,
                  workers: int = 0) -> list[Request]:
    """Up to n requests from the functions of `texts` (parsed in `workers` processes),
    kinds drawn by weight. answered_only: only kinds with a reference answer (no
    teacher generation)."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS if not answered_only or k in ("write", "rename")]
    weights = [KINDS[k][1] for k in kinds]
    order = list(range(len(texts)))
    rng.shuffle(order)
    out: list[Request] = []
    parsed = _map(functions_of, (texts[i] for i in order), workers)
    for funcs in parsed:
        rng.shuffle(funcs)
        for f in funcs[:2]:   # a few per file: breadth over depth
            req = KINDS[rng.choices(kinds, weights)[0]][0](f, rng)
            if req is not None:
                out.append(req)
        if len(out) >= n:
            break
    if hasattr(parsed, "close"):
        parsed.close()   # stops the workers early
    return out[:n]


def _map(fn, items, workers: int):
    """fn over items in order, lazily; in `workers` forked processes when > 0."""
    if workers <= 0:
        yield from map(fn, items)
        return
    import multiprocessing as mp
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(workers) as pool:
        yield from pool.imap(fn, items, chunksize=8)

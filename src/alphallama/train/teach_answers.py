"""A coder model's answers to code-writing requests: which ones the student may learn
from, and the file that carries them from `python -m alphallama.train.teach` to
`python -m alphallama.train run --teacher-answers`.

    judge(text)                  -> (the answer to keep, or None; why): the answer's code
                                    (quality.answer_code) must parse, define a function with a
                                    body, and be plausible (names.py) with only its import lines
    closed_fence(text)           -> the text holds a whole fenced code block
    write_answers(path, rows)    -> gzipped JSON lines {"request", "answer"}
    read_answers(path)           -> [(request, answer)]
    summary_path(path)           -> where teach writes its summary (answers.summary.json)
    answers_record(path, ...)    -> the provenance the trainer records (file, sha256, teacher)

A kept answer is rewritten as one fenced block of the code's top-level imports (only the
names its functions read) and functions, in that order (the shape of the corpus answers,
instruct.FunctionCase.answer): the teacher's prose and example calls are dropped. A 30M student spends its capacity on
the code, and what the evaluation reads is the first fenced block (quality.answer_code).
The filter runs on the rewritten code, so a function that reads a top-level constant the
rewrite dropped is not plausible and not kept.
"""
from __future__ import annotations

import ast
import gzip
import json
import re
from pathlib import Path
from typing import Iterable

from .edits import PY_FENCE
from .instruct import _is_stub
from .names import free_names, plausible
from .parts import sha256_file
from .quality import answer_code

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
REASONS = ("kept", "syntax", "no function", "stub", "relative import", "invented names")


def _lines(code: str, node: ast.stmt) -> str:
    """A top-level statement's source lines, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return "\n".join(code.splitlines()[first - 1:node.end_lineno]).rstrip()


def _has_body(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = func.body[1:] if ast.get_docstring(func) is not None else func.body
    return bool(body) and not all(_is_stub(s) for s in body)


def _needed_imports(imports: list[ast.Import | ast.ImportFrom], reads: set[str]) -> str:
    """The import lines, in order, with only the names the functions read (a star import, or
    `from typing import *` beside a function that reads nothing of it, goes)."""
    out = []
    for stmt in imports:
        names = [a for a in stmt.names if a.name != "*" and (a.asname or a.name).split(".")[0] in reads]
        if names:
            out.append(ast.unparse(type(stmt)(**{**vars(stmt), "names": names})))
    return "\n".join(out)


def judge(text: str) -> tuple[str | None, str]:
    """(the kept answer: a fenced block of imports then functions; or None, and why: one of
    REASONS). Other top-level statements (example calls, prints, constants) are dropped."""
    code = answer_code(text)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None, "syntax"
    funcs = [s for s in tree.body if isinstance(s, FUNCS)]
    if not funcs:
        return None, "no function"
    if not all(_has_body(f) for f in funcs):
        return None, "stub"
    imports = [s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom))]
    if any(isinstance(s, ast.ImportFrom) and s.level for s in imports):
        return None, "relative import"
    head = _needed_imports(imports, set().union(*(free_names(f) for f in funcs)))
    kept = (head + "\n\n\n" if head else "") + "\n\n\n".join(_lines(code, f) for f in funcs)
    if not plausible(kept):
        return None, "invented names"
    return PY_FENCE.format(kept), "kept"


_CLOSED = re.compile(r"```(?:python|py)?\n.*?\n```", re.DOTALL)


def closed_fence(text: str) -> bool:
    """Does the text hold a whole fenced code block (an answer cut after it lost only prose)?"""
    return _CLOSED.search(text) is not None


def write_answers(path: str | Path, rows: Iterable[tuple[str, str]]) -> int:
    """Gzipped JSON lines {"request", "answer"} (mtime 0: the same answers, the same
    bytes and sha256); returns the number written."""
    lines = [json.dumps({"request": q, "answer": a}, ensure_ascii=False) + "\n" for q, a in rows]
    Path(path).write_bytes(gzip.compress("".join(lines).encode(), mtime=0))
    return len(lines)


def read_answers(path: str | Path) -> list[tuple[str, str]]:
    """The (request, answer) pairs of an answers file; ValueError on a malformed line."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                q, a = row["request"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a {{\"request\", \"answer\"}} line ({e})") from None
            if not (isinstance(q, str) and isinstance(a, str) and q and a):
                raise ValueError(f"{path}:{n}: request and answer must be non-empty strings")
            out.append((q, a))
    return out


def summary_path(path: str | Path) -> Path:
    """answers.jsonl.gz -> answers.summary.json (beside it)."""
    p = Path(path)
    stem = p.name
    for suffix in (".gz", ".jsonl", ".json"):
        stem = stem[:-len(suffix)] if stem.endswith(suffix) else stem
    return p.with_name(stem + ".summary.json")


def answers_record(path: str | Path, n_answers: int, used: int, share: float | None, repeat: int = 1) -> dict:
    """What the trainer records of the answers it took: the file's name and sha256, how
    many it holds, how many examples went in (`repeat` an answer at most), and the teacher
    model's name and sha256 when teach's summary lies beside the file."""
    rec = {"file": Path(path).name, "sha256": sha256_file(Path(path)), "answers": n_answers, "used": used,
           "share": share, "repeat": repeat}
    s = summary_path(path)
    if s.is_file():
        try:
            summ = json.loads(s.read_text())
            rec |= {"teacher": summ.get("teacher"), "teacher_sha256": summ.get("teacher_sha256")}
        except (OSError, ValueError):
            pass
    return rec

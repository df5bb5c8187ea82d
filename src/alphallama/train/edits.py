"""File edits a program can make and check: the instruction data of the embedded model
and its held-out evaluation.

Each task kind is one `Task` in `TASKS`: `make(text, rng)` returns an `Edit` (the
instruction, the input, the expected output) or None when the text does not suit it;
`check(edit)` verifies the output by a different route than the one that made it
(properties of the token stream, the parsed rows), so a test of the generators proves
the edits right. Text tasks work on a Python snippet; CSV and log tasks make their own
data from `rng`.
"""
from __future__ import annotations

import ast
import csv
import io
import keyword
import random
import re
import tokenize
from dataclasses import dataclass, field
from typing import Callable

PY_FENCE = "```python\n{}\n```"
FENCE = "```\n{}\n```"


@dataclass(frozen=True)
class Edit:
    kind: str
    prompt: str        # the user message (instruction + fenced input)
    source: str        # the input text
    output: str        # the exact expected output text
    params: dict = field(default_factory=dict)
    fence: str = PY_FENCE      # how the input and the answer are fenced

    @property
    def answer(self) -> str:
        """The assistant message: the output in a fence like the input's."""
        return self.fence.format(self.output)


@dataclass(frozen=True)
class Task:
    kind: str
    make: Callable[[str, random.Random], Edit | None]
    check: Callable[[Edit], bool]
    needs_code: bool = True     # works on a Python snippet (else makes its own data)


def _tokens(text: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(text).readline))


def _safe_tokens(text: str) -> list[tokenize.TokenInfo] | None:
    """Tokens of a snippet without f-strings (Python 3.12 tokenizes their insides, older
    versions do not: keep tasks the same on every interpreter)."""
    try:
        toks = _tokens(text)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    if any(t.type == getattr(tokenize, "FSTRING_START", -1) or
           (t.type == tokenize.STRING and "f" in _prefix(t.string).lower()) for t in toks):
        return None
    return toks


def _prefix(s: str) -> str:
    return s[:len(s) - len(s.lstrip("rRbBuUfF"))]


def _replace_spans(text: str, spans: list[tuple[tuple[int, int], tuple[int, int], str]]) -> str:
    """Replace (start, end) token spans ((row, col), 1-based rows) by new strings."""
    lines = text.splitlines(keepends=True)
    for (r0, c0), (r1, c1), new in sorted(spans, reverse=True):
        if r0 != r1:
            raise ValueError("multi-line spans are not edited")
        line = lines[r0 - 1]
        lines[r0 - 1] = line[:c0] + new + line[c1:]
    return "".join(lines)


def _significant(toks, drop=(tokenize.COMMENT, tokenize.NL)):
    return [(t.type, t.string) for t in toks if t.type not in drop]


# --- rename an identifier --------------------------------------------------------------

_WORDS = ("data", "item", "value", "result", "config", "spec", "entry", "node", "key", "info",
          "state", "buffer", "ctx", "opts", "parts", "record", "target", "source", "handler", "cache")


def _new_name(old: str, taken: set[str], rng: random.Random) -> str | None:
    for _ in range(20):
        parts = old.strip("_").split("_") if "_" in old.strip("_") else [old]
        i = rng.randrange(len(parts))
        word = rng.choice(_WORDS)
        parts[i] = word.capitalize() if parts[i][:1].isupper() else word
        new = old[:len(old) - len(old.lstrip("_"))] + "_".join(parts)
        if rng.random() < 0.3:
            new = new + "_" + rng.choice(_WORDS)
        if new != old and new not in taken and not keyword.iskeyword(new) and new.isidentifier():
            return new
    return None


def make_rename(text: str, rng: random.Random) -> Edit | None:
    toks = _safe_tokens(text)
    if toks is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    defined: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.setdefault(node.name, "function")
        elif isinstance(node, ast.ClassDef):
            defined.setdefault(node.name, "class")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.setdefault(node.id, "variable")
    names = [t.string for t in toks if t.type == tokenize.NAME]
    cands = sorted(n for n in defined if names.count(n) >= 2 and len(n) > 2 and not n.startswith("__"))
    if not cands:
        return None
    old = rng.choice(cands)
    new = _new_name(old, set(names), rng)
    if new is None:
        return None
    out = _replace_spans(text, [(t.start, t.end, new) for t in toks
                                if t.type == tokenize.NAME and t.string == old])
    what = defined[old]
    prompt = (f"Rename the {what} `{old}` to `{new}` everywhere in this file. Return the whole file."
              f"\n\n{PY_FENCE.format(text)}")
    return Edit("rename", prompt, text, out, {"old": old, "new": new})


def check_rename(e: Edit) -> bool:
    a, b = _tokens(e.source), _tokens(e.output)
    old, new = e.params["old"], e.params["new"]
    if len(a) != len(b) or e.source.count("\n") != e.output.count("\n"):
        return False
    for x, y in zip(a, b):
        want = new if (x.type == tokenize.NAME and x.string == old) else x.string
        if (x.type, want) != (y.type, y.string):
            return False
    return old not in {t.string for t in b if t.type == tokenize.NAME}


# --- remove comments -----------------------------------------------------------------

def make_remove_comments(text: str, rng: random.Random) -> Edit | None:
    toks = _safe_tokens(text)
    if toks is None:
        return None
    comments = [t for t in toks if t.type == tokenize.COMMENT]
    if not comments:
        return None
    lines = text.splitlines(keepends=True)
    drop, cut = set(), {}
    for t in comments:
        r, c = t.start
        if lines[r - 1][:c].strip() == "":
            drop.add(r)
        else:
            cut[r] = c
    out = []
    for i, line in enumerate(lines, start=1):
        if i in drop:
            continue
        if i in cut:
            nl = "\n" if line.endswith("\n") else ""
            line = line[:cut[i]].rstrip() + nl
        out.append(line)
    prompt = ("Remove every comment from this file, keep everything else unchanged. Return the whole file."
              f"\n\n{PY_FENCE.format(text)}")
    return Edit("remove_comments", prompt, text, "".join(out), {"n": len(comments)})


def check_remove_comments(e: Edit) -> bool:
    try:
        b = _tokens(e.output)
    except (tokenize.TokenError, SyntaxError):
        return False
    a = _tokens(e.source)
    if any(t.type == tokenize.COMMENT for t in b):
        return False
    sig = lambda ts: [(ty, s) for ty, s in _significant(ts, (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE))]  # noqa: E731
    if sig(a) != sig(b):
        return False
    # only comment-only lines disappear; every kept line is the source line minus its comment
    kept = [ln for ln in e.source.splitlines() if not ln.lstrip().startswith("#")]
    return len(kept) == len(e.output.splitlines()) and all(
        k.startswith(o) for k, o in zip(kept, e.output.splitlines()))


# --- switch quote style ----------------------------------------------------------------

def make_quotes(text: str, rng: random.Random) -> Edit | None:
    toks = _safe_tokens(text)
    if toks is None:
        return None
    src, dst = rng.choice([("'", '"'), ('"', "'")])
    plain = [t for t in toks if t.type == tokenize.STRING and not _prefix(t.string)
             and not t.string.startswith(src * 3) and t.string[0] == src]
    if len(plain) < 2 or any(dst in t.string[1:-1] or "\\" in t.string for t in plain):
        return None
    out = _replace_spans(text, [(t.start, t.end, dst + t.string[1:-1] + dst) for t in plain])
    name = {"'": "single", '"': "double"}
    prompt = (f"Change every {name[src]}-quoted string in this file to {name[dst]} quotes. "
              f"Return the whole file.\n\n{PY_FENCE.format(text)}")
    return Edit("quotes", prompt, text, out, {"from": src, "to": dst})


def check_quotes(e: Edit) -> bool:
    a, b = _tokens(e.source), _tokens(e.output)
    if len(a) != len(b):
        return False
    src = e.params["from"]
    for x, y in zip(a, b):
        if x.type != y.type:
            return False
        if x.type == tokenize.STRING:
            if ast.literal_eval(x.string) != ast.literal_eval(y.string):
                return False
            single_line = not _prefix(y.string) and y.string[:3] not in ('"""', "'''")
            if single_line and y.string[0] == src:
                return False
        elif x.string != y.string:
            return False
    return True


# --- return the file unchanged ---------------------------------------------------------

_UNCHANGED = ("Return this file unchanged.", "Repeat this file exactly as it is, with no changes.",
              "Copy this file back to me without changing anything.")


def make_unchanged(text: str, rng: random.Random) -> Edit | None:
    return Edit("unchanged", f"{rng.choice(_UNCHANGED)}\n\n{PY_FENCE.format(text)}", text, text)


def check_unchanged(e: Edit) -> bool:
    return e.output == e.source


# --- CSV rows --------------------------------------------------------------------------

_NAMES = ("Ada", "Grace", "Linus", "Ken", "Radia", "Edsger", "Barbara", "Donald", "Frances", "John")
_CITIES = ("Oslo", "Lima", "Pune", "Quito", "Osaka", "Hanoi", "Lisbon", "Nairobi")
_HEADER = ("id", "name", "city", "age", "score")


def random_csv(rng: random.Random, n: int | None = None) -> list[list[str]]:
    n = n or rng.randint(6, 24)
    return [[str(i), rng.choice(_NAMES), rng.choice(_CITIES), str(rng.randint(18, 80)),
             f"{rng.uniform(0, 100):.1f}"] for i in range(1, n + 1)]


def _csv_text(rows: list[list[str]]) -> str:
    return "\n".join(",".join(r) for r in [list(_HEADER), *rows])


def _key(col: str) -> Callable[[list[str]], object]:
    i = _HEADER.index(col)
    return (lambda r: float(r[i])) if col in ("age", "score") else (lambda r: r[i])


def make_csv_sort(_text: str, rng: random.Random) -> Edit | None:
    rows = random_csv(rng)
    col = rng.choice(("score", "age", "name", "city"))
    desc = rng.random() < 0.5
    out = sorted(rows, key=_key(col), reverse=desc)   # stable in both directions
    order = ("highest first" if desc else "lowest first") if col in ("age", "score") else \
        ("in reverse alphabetical order" if desc else "alphabetically")
    src = _csv_text(rows)
    prompt = (f"Sort the rows of this CSV by {col}, {order}; keep rows that tie in their order. "
              f"Return the whole CSV.\n\n{FENCE.format(src)}")
    return Edit("csv_sort", prompt, src, _csv_text(out), {"col": col, "desc": desc}, FENCE)


def _parse_csv(text: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(text))]


def check_csv_sort(e: Edit) -> bool:
    a, b = _parse_csv(e.source), _parse_csv(e.output)
    if a[0] != b[0] or sorted(a[1:]) != sorted(b[1:]):
        return False
    key, desc = _key(e.params["col"]), e.params["desc"]
    rank = {tuple(r): i for i, r in enumerate(a[1:])}     # ids make rows unique
    for x, y in zip(b[1:], b[2:]):
        kx, ky = key(x), key(y)
        if (kx < ky if desc else kx > ky) or (kx == ky and rank[tuple(x)] > rank[tuple(y)]):
            return False
    return True


def make_csv_filter(_text: str, rng: random.Random) -> Edit | None:
    rows = random_csv(rng)
    if rng.random() < 0.5:
        col, op = rng.choice((("score", ">"), ("score", "<"), ("age", ">"), ("age", "<")))
        value = rng.randint(20, 80) if col == "score" else rng.randint(25, 70)
        keep = [r for r in rows if (_key(col)(r) > value if op == ">" else _key(col)(r) < value)]
        cond = f"{col} is {'greater' if op == '>' else 'less'} than {value}"
    else:
        col, op, value = "city", "==", rng.choice([r[2] for r in rows])
        keep = [r for r in rows if r[2] == value]
        cond = f"the city is {value}"
    src = _csv_text(rows)
    prompt = (f"Keep only the rows of this CSV where {cond}. Return the whole CSV with its header."
              f"\n\n{FENCE.format(src)}")
    return Edit("csv_filter", prompt, src, _csv_text(keep), {"col": col, "op": op, "value": value}, FENCE)


def check_csv_filter(e: Edit) -> bool:
    a, b = _parse_csv(e.source), _parse_csv(e.output)
    col, op, value = e.params["col"], e.params["op"], e.params["value"]
    i = _HEADER.index(col)
    test = {">": lambda s: float(s) > value, "<": lambda s: float(s) < value, "==": lambda s: s == value}[op]
    return a[0] == b[0] and b[1:] == [r for r in a[1:] if test(r[i])]


# --- access logs -----------------------------------------------------------------------

_PATHS = ("/", "/login", "/logout", "/api/items", "/api/users/42", "/static/app.js", "/health", "/search?q=x")
_METHODS = ("GET", "GET", "GET", "POST", "PUT", "DELETE")
_STATUS = ("200", "200", "200", "201", "301", "404", "500", "403")


def random_log(rng: random.Random, n: int | None = None) -> list[list[str]]:
    """Rows of [ip, time, method, path, status, bytes, ms]."""
    n = n or rng.randint(5, 16)
    t = rng.randint(0, 3000)
    rows = []
    for _ in range(n):
        t += rng.randint(1, 120)
        ip = f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
        stamp = f"29/Nov/2026:{10 + t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} +0000"
        rows.append([ip, stamp, rng.choice(_METHODS), rng.choice(_PATHS), rng.choice(_STATUS),
                     str(rng.randint(100, 90000)), f"{rng.randint(1, 999)}ms"])
    return rows


def _log_text(rows: list[list[str]]) -> str:
    return "\n".join(f'{ip} - - [{ts}] "{m} {p} HTTP/1.1" {s} {b} {ms}' for ip, ts, m, p, s, b, ms in rows)


_LOG_RE = re.compile(r'^(\S+) - - \[([^\]]+)\] "(\S+) (\S+) HTTP/1\.1" (\d+) (\d+) (\d+ms)$')


def make_log_replace(_text: str, rng: random.Random) -> Edit | None:
    rows = random_log(rng)
    field_, new = rng.choice((("ip", "0.0.0.0"), ("status", None), ("method", None)))
    if field_ == "ip":
        out = [["0.0.0.0", *r[1:]] for r in rows]
        instr, params = "replace every IP address with 0.0.0.0", {"field": 0, "old": None, "new": "0.0.0.0"}
    else:
        i = 4 if field_ == "status" else 2
        old = rng.choice([r[i] for r in rows])
        pool = _STATUS if field_ == "status" else _METHODS
        new = rng.choice([x for x in set(pool) | ({"410", "418"} if i == 4 else {"PATCH"}) if x != old])
        out = [[new if (j == i and v == old) else v for j, v in enumerate(r)] for r in rows]
        what = "status code" if field_ == "status" else "request method"
        instr, params = f"replace the {what} {old} with {new} on every line", {"field": i, "old": old, "new": new}
    src = _log_text(rows)
    prompt = f"In this log, {instr} and return the whole log.\n\n{FENCE.format(src)}"
    return Edit("log_replace", prompt, src, _log_text(out), params, FENCE)


def check_log_replace(e: Edit) -> bool:
    a = [_LOG_RE.match(x) for x in e.source.splitlines()]
    b = [_LOG_RE.match(x) for x in e.output.splitlines()]
    if len(a) != len(b) or not all(a) or not all(b):
        return False
    f, old, new = e.params["field"], e.params["old"], e.params["new"]
    for x, y in zip(a, b):
        gx, gy = list(x.groups()), list(y.groups())
        if old is None or gx[f] == old:
            gx[f] = new
        if gx != gy:
            return False
    return True


TASKS: dict[str, Task] = {t.kind: t for t in (
    Task("rename", make_rename, check_rename),
    Task("remove_comments", make_remove_comments, check_remove_comments),
    Task("quotes", make_quotes, check_quotes),
    Task("unchanged", make_unchanged, check_unchanged),
    Task("csv_sort", make_csv_sort, check_csv_sort, needs_code=False),
    Task("csv_filter", make_csv_filter, check_csv_filter, needs_code=False),
    Task("log_replace", make_log_replace, check_log_replace, needs_code=False),
)}

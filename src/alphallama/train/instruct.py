"""Instruction examples in ChatML, rendered with the chat template the model ships
(Qwen2.5's, `chat_template.jinja` beside this file), so training sees exactly the
prompt format the engine will build.

    snippet(text, rng, max_chars)        -> a run of whole top-level statements of a file
    function_cases(text)                 -> [FunctionCase]: the documented functions of a file,
                                            each with the file's import lines it needs
    write_function_edit(case, style)     -> an Edit: a request in one of N_STYLES styles (a
                                            plain-language one of requests.py, a signature and
                                            docstring, a header), the corpus function as answer
    make_write_function(text, rng)       -> such an Edit for a random function and style
    make_examples(texts, n, seed, weights=...) -> [Edit], edit tasks and requests mixed
    teacher_edit(request, answer)        -> an Edit answered by the teacher model (teach.py),
                                            mixed into the requests by TeacherMix
    render(edit, system=None)            -> the ChatML text of one user/assistant exchange
"""
from __future__ import annotations

import ast
import random
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .edits import PY_FENCE, TASKS, Edit
from .names import BUILTINS, free_names
from .requests import PHRASINGS, request, summary

SYSTEM_PROMPTS = ("You are a helpful coding assistant.", "You are a careful programmer. Answer with code only.")


@lru_cache(maxsize=1)
def chat_template_text() -> str:
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()


def snippet(text: str, rng: random.Random, max_chars: int) -> str | None:
    """Consecutive whole top-level statements (decorators and comments between them
    included) of at most max_chars characters, from a random starting statement."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes = tree.body
    if not nodes:
        return None
    lines = text.splitlines()
    first = lambda n: min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
    start = rng.randrange(len(nodes))
    lo, hi = first(nodes[start]), nodes[start].end_lineno
    if sum(len(x) + 1 for x in lines[lo - 1:hi]) > max_chars:
        return None
    for n in nodes[start + 1:]:
        if sum(len(x) + 1 for x in lines[lo - 1:n.end_lineno]) > max_chars:
            break
        hi = n.end_lineno
    out = "\n".join(lines[lo - 1:hi]).rstrip()
    return out if out.count("\n") >= 2 else None


def _is_stub(stmt: ast.stmt) -> bool:
    """pass, ..., or raise NotImplementedError: a body that shows nothing to write."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt.value.value is Ellipsis:
        return True
    exc = stmt.exc.func if isinstance(stmt, ast.Raise) and isinstance(stmt.exc, ast.Call) else getattr(stmt, "exc", None)
    return isinstance(stmt, ast.Raise) and isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def _functions(tree: ast.AST):
    """Functions with a docstring and a body beyond it (no abstract stubs)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) \
                and not all(_is_stub(s) for s in node.body[1:]):
            yield node


@dataclass(frozen=True)
class FunctionCase:
    """A corpus function that can answer a code-writing request."""
    name: str
    sig: str          # "name(args) -> ret"
    doc: str          # the docstring's first paragraph
    src: str          # the function's source, dedented
    method: bool      # takes self/cls: only the signature phrasings suit it
    imports: str = ""     # the file's import lines for the modules and names it reads
    closed: bool = True   # with `imports` it reads nothing else but builtins (names.py)

    @property
    def answer(self) -> str:
        """The answer to a request for it: the imports it needs, then the function."""
        return f"{self.imports}\n\n\n{self.src}" if self.imports else self.src


def _import_lines(tree: ast.Module) -> dict[str, tuple[int, int, str, str]]:
    """{bound name: (statement index, alias index, module, alias text)} of the module's absolute
    top-level imports (not __future__): `import a.b as c` binds c, `from m import x` x."""
    out: dict[str, tuple[int, str, str]] = {}
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, ast.ImportFrom) and (stmt.level or stmt.module in (None, "__future__")):
            continue
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for j, a in enumerate(stmt.names):
                if a.name == "*":
                    continue
                text = a.name + (f" as {a.asname}" if a.asname else "")
                name = a.asname or a.name.split(".")[0]
                out[name] = (i, j, "" if isinstance(stmt, ast.Import) else stmt.module, text)
    return out


def _needed_imports(needs: set[str], imports: dict[str, tuple[int, int, str, str]]) -> str:
    """The import lines that bind `needs`, in the file's order, one `from` line a statement."""
    lines: dict[tuple[int, str], list[str]] = {}
    for name in sorted(needs, key=lambda n: imports[n][:2]):
        i, _, mod, text = imports[name]
        lines.setdefault((i, mod), []).append(text)
    out = []
    for (_, mod), texts in lines.items():
        out += [f"import {t}" for t in texts] if not mod else [f"from {mod} import {', '.join(texts)}"]
    return "\n".join(out)


def function_cases(text: str, max_chars: int = 1400) -> list[FunctionCase]:
    """Every documented function of 3..40 lines (at most max_chars) of a file; `closed`
    when the names it reads are builtins or bound by the file's absolute imports (which
    its answer then starts with)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    lines = text.splitlines()
    imports = _import_lines(tree)
    out = []
    for node in _functions(tree):
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if not (3 <= src.count("\n") <= 40 and len(src) <= max_chars and src.startswith(("def ", "async def "))):
            continue
        doc = ast.get_docstring(node).strip().split("\n\n")[0].strip()
        if not 10 <= len(doc) <= 400:
            continue
        try:
            ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            sig = f"{node.name}({ast.unparse(node.args)}){ret}"
        except (ValueError, AttributeError):
            continue
        first = node.args.posonlyargs + node.args.args
        needs = free_names(node) - BUILTINS
        closed = needs <= imports.keys()
        out.append(FunctionCase(node.name, sig, doc, src, bool(first) and first[0].arg in ("self", "cls"),
                                _needed_imports(needs, imports) if closed else "", closed))
    return out


# the request styles: the plain-language phrasings of requests.py, then the two forms
# that show the signature (a signature and the docstring; a header to complete)
N_STYLES = len(PHRASINGS) + 2


def write_function_edit(case: FunctionCase, style: int) -> Edit | None:
    """The request of `style` (0..N_STYLES-1) answered by the case's function; None when
    the style does not suit it (no verb to phrase, a method asked for as a function)."""
    if style < len(PHRASINGS):
        sentence = summary(case.doc)
        if case.method or sentence is None:
            return None
        prompt = request(case.name, case.sig, sentence, style)
        if prompt is None:
            return None
    elif style == len(PHRASINGS):
        prompt = f"Write a Python function `{case.sig}`.\n\n{case.doc}"
    else:
        kw = "async def" if case.src.startswith("async ") else "def"
        header = f"{kw} {case.sig}:\n" + textwrap.indent(f'"""{case.doc}"""', "    ")
        prompt = f"Complete this Python function.\n\n{PY_FENCE.format(header)}"
    return Edit("write_function", prompt, case.answer, case.answer, {"name": case.name})


def make_write_function(text: str, rng: random.Random, max_chars: int = 1400) -> Edit | None:
    cases = function_cases(text, max_chars)
    if not cases:
        return None
    case = rng.choice(cases)
    styles = rng.sample(range(N_STYLES), N_STYLES)
    return next((e for s in styles if (e := write_function_edit(case, s)) is not None), None)


class FunctionPool:
    """Every function case of the texts, asked for in one style per pass: the closed cases
    (names.py: they read only builtins and the imports their answer starts with) in all
    their styles first, then the others, so an answer that reads names it never defines
    is taught only once the closed ones are spent. Within a group, pass r asks each case
    (in a random order) in its r-th fitting style (plain-language ones first, in a random
    order of its own): no function is asked for twice before every one of its group has
    been asked for once, and no (function, style) repeats; None when all are spent."""

    def __init__(self, texts: list[str], rng: random.Random, max_chars: int,
                 cases: list[FunctionCase] | None = None):
        """cases: already made from the texts (the texts are then not parsed again)."""
        cases = list(cases) if cases is not None else [c for t in texts for c in function_cases(t, max_chars)]
        rng.shuffle(cases)
        self.groups = [[c for c in cases if c.closed], [c for c in cases if not c.closed]]
        self.rng = rng
        self.styles: dict[tuple[int, int], list[Edit]] = {}
        self.g = self.i = 0

    @property
    def cases(self) -> list[FunctionCase]:
        return self.groups[0] + self.groups[1]

    def _fitting(self, k: int) -> list[Edit]:
        key = (self.g, k)
        if key not in self.styles:
            # plain-language requests first: they are what users type
            plain, shown = list(range(len(PHRASINGS))), list(range(len(PHRASINGS), N_STYLES))
            order = self.rng.sample(plain, len(plain)) + self.rng.sample(shown, len(shown))
            case = self.groups[self.g][k]
            self.styles[key] = [e for s in order if (e := write_function_edit(case, s)) is not None]
        return self.styles[key]

    def next(self) -> Edit | None:
        while self.g < len(self.groups):
            n = len(self.groups[self.g])
            while n and self.i < n * N_STYLES:
                k, rnd = self.i % n, self.i // n
                self.i += 1
                fitting = self._fitting(k)
                if rnd < len(fitting):
                    return fitting[rnd]
            self.g, self.i = self.g + 1, 0
        return None


TEACHER_KIND = "write_function_teacher"


def teacher_edit(request: str, answer: str) -> Edit:
    """A code-writing request answered by the teacher model (train/teach.py): its answer is
    the whole assistant turn as written, not a fenced output."""
    return Edit(TEACHER_KIND, request, answer, answer, fence="{}")


class TeacherMix:
    """Code-writing requests: the teacher's answered requests mixed into a FunctionPool's.
    share None: every teacher example first, then the pool's; else request j (0-based) is
    the teacher's when fewer than share * (j + 1) of requests 0..j-1 were, so the two
    interleave at that share until the teacher's run out. The pool's requests that a teacher example asks in
    the same words (`asked`, the whole file's requests) are skipped: no request is
    taught with two answers."""

    def __init__(self, pool: FunctionPool, teacher: list[Edit], share: float | None, asked: frozenset[str]):
        self.pool, self.teacher, self.share, self.asked = pool, teacher, share, asked
        self.j = self.t = 0

    def next(self) -> Edit | None:
        self.j += 1
        if self.t < len(self.teacher) and (self.share is None or self.t < self.share * self.j):
            self.t += 1
            return self.teacher[self.t - 1]
        while (e := self.pool.next()) is not None and e.prompt in self.asked:
            pass
        return e


def check_write_function(e: Edit) -> bool:
    try:
        tree = ast.parse(e.output)
    except SyntaxError:
        return False
    # the answer is the corpus function itself, whole and parseable, after the imports it needs
    *head, last = tree.body or [None]
    return (e.output == e.source and all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in head)
            and isinstance(last, (ast.FunctionDef, ast.AsyncFunctionDef))
            and last.name == e.params["name"] and bool(ast.get_docstring(last)))


def make_edit(kind: str, text: str, rng: random.Random, max_chars: int) -> Edit | None:
    """One task of `kind` from a corpus file (a snippet of it for code tasks)."""
    if kind == "write_function":
        return make_write_function(text, rng, max_chars)
    task = TASKS[kind]
    if not task.needs_code:
        return task.make("", rng)
    snip = snippet(text, rng, max_chars)
    return None if snip is None else task.make(snip, rng)


KINDS = (*TASKS, "write_function")


def make_examples(texts: list[str], n: int, seed: int = 0, max_chars: int = 1400,
                  kinds: tuple[str, ...] = KINDS, weights: dict[str, int] | None = None,
                  teacher: list[Edit] | None = None, teacher_share: float | None = None,
                  teacher_asked: frozenset[str] = frozenset()) -> list[Edit]:
    """n examples, kinds in turn (kind k `weights[k]` times per turn, default 1): code
    tasks from randomly drawn files (texts with no suitable part are skipped; gives up
    after 20 tries per example), code-writing requests from a FunctionPool of all texts,
    mixed with `teacher` examples (teacher_edit) as TeacherMix does."""
    rng = random.Random(seed)
    turn = [k for k in kinds for _ in range((weights or {}).get(k, 1))]
    pool = FunctionPool(texts, rng, max_chars) if "write_function" in kinds else None
    if pool is not None and teacher:
        pool = TeacherMix(pool, teacher, teacher_share, teacher_asked)
    out: list[Edit] = []
    tries = 0
    while len(out) < n and tries < 20 * n and texts and turn:
        kind = turn[len(out) % len(turn)]
        e = pool.next() if kind == "write_function" else make_edit(kind, rng.choice(texts), rng, max_chars)
        tries += 1
        if e is not None:
            out.append(e)
    return out


def render(edit: Edit, template, system: str | None = None) -> str:
    """The ChatML text of one exchange, through `template` (an alphallama.chat.ChatTemplate)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": edit.prompt}, {"role": "assistant", "content": edit.answer}]
    return template.render(msgs, add_generation_prompt=False)


def make_template():
    from ..chat import ChatTemplate
    return ChatTemplate(chat_template_text(), bos_token="<|endoftext|>", eos_token="<|im_end|>")

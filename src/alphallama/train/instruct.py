"""Instruction examples in ChatML, rendered with the chat template the model ships
(Qwen2.5's, `chat_template.jinja` beside this file), so training sees exactly the
prompt format the engine will build.

    snippet(text, rng, max_chars)        -> a run of whole top-level statements of a file
    make_write_function(text, rng)       -> an Edit: a docstring or signature as the
                                            request, the corpus function as the answer
    make_examples(texts, n, seed)        -> [Edit], edit tasks and code-writing requests mixed
    render(edit, system=None)            -> the ChatML text of one user/assistant exchange
"""
from __future__ import annotations

import ast
import random
import textwrap
from functools import lru_cache
from importlib import resources

from .edits import PY_FENCE, TASKS, Edit

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
    first = lambda n: min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])  # noqa: E731
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


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            yield node


def make_write_function(text: str, rng: random.Random, max_chars: int = 1400) -> Edit | None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    lines = text.splitlines()
    cands = []
    for node in _functions(tree):
        src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if 3 <= src.count("\n") <= 40 and len(src) <= max_chars and src.startswith(("def ", "async def ")):
            cands.append((node, src))
    if not cands:
        return None
    node, src = rng.choice(cands)
    doc = ast.get_docstring(node).strip().split("\n\n")[0].strip()
    if not 10 <= len(doc) <= 400:
        return None
    try:
        args = ast.unparse(node.args)
        ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    except (ValueError, AttributeError):
        return None
    sig = f"{node.name}({args}){ret}"
    if rng.random() < 0.5:
        prompt = f"Write a Python function `{sig}`.\n\n{doc}"
    else:
        header = f"def {sig}:\n" + textwrap.indent(f'"""{doc}"""', "    ")
        prompt = f"Complete this Python function.\n\n{PY_FENCE.format(header)}"
    return Edit("write_function", prompt, src, src, {"name": node.name})


def check_write_function(e: Edit) -> bool:
    try:
        tree = ast.parse(e.output)
    except SyntaxError:
        return False
    # the answer is the corpus function itself, whole and parseable
    return (e.output == e.source and len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
            and tree.body[0].name == e.params["name"] and bool(ast.get_docstring(tree.body[0])))


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
                  kinds: tuple[str, ...] = KINDS) -> list[Edit]:
    """n examples, kinds in turn, code tasks from randomly drawn files (texts with no
    suitable part are skipped; gives up after 20 tries per example)."""
    rng = random.Random(seed)
    out: list[Edit] = []
    tries = 0
    while len(out) < n and tries < 20 * n and texts:
        kind = kinds[len(out) % len(kinds)]
        e = make_edit(kind, rng.choice(texts), rng, max_chars)
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

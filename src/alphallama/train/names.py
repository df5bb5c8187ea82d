"""Which names a function needs from outside itself (ast only, nothing is run).

A self-contained function reads only its parameters, its locals, the builtins and the
modules it imports inside: pasted alone into a file it runs. The embedded model learns
to answer a code-writing request from corpus functions; one that reads a module global
(`if name in _PROGRESSORS`) teaches it to write answers that name things that do not
exist. The evaluation asks the same of the model's answers ('plausible').

    free_names(func)            -> names a def (ast node) reads and binds nowhere
    self_contained(func)        -> free_names(func) <= builtins
    plausible(code)             -> the code parses, defines a top-level function, and every
                                   top-level function's free names are builtins or bound
                                   at the code's top level (its imports, defs, assignments)

Scoping is simplified: a name bound anywhere inside the function (nested scopes too)
counts as bound, so `free_names` may miss a name read in one scope and bound only in
another (rare; it errs towards 'self-contained'). Names declared `global` or `nonlocal`
are free. Decorators, default values and annotations are read where the def is run, so
they count (an annotation `List[int]` needs `List`), unless the code has
`from __future__ import annotations`, which is not assumed.
"""
from __future__ import annotations

import ast
import builtins

BUILTINS = frozenset(dir(builtins))


def _arg_names(args: ast.arguments) -> set[str]:
    every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return {a.arg for a in every}


def _bound(node: ast.AST) -> set[str]:
    """Names bound by a node itself (not by its children)."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return {node.id}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        out = {node.name}
        if not isinstance(node, ast.ClassDef):
            out |= _arg_names(node.args)
        return out | {p.name for p in getattr(node, "type_params", [])}
    if isinstance(node, ast.Lambda):
        return _arg_names(node.args)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    if isinstance(node, ast.ExceptHandler) and node.name:
        return {node.name}
    if isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
        return {node.name}
    if isinstance(node, ast.MatchMapping) and node.rest:
        return {node.rest}
    return set()


def _outer_parts(func: ast.AST) -> list[ast.AST]:
    """What a def or class statement evaluates where it stands: decorators, defaults,
    annotations, bases."""
    parts = list(getattr(func, "decorator_list", []))
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = func.args
        parts += a.defaults + [d for d in a.kw_defaults if d is not None]
        parts += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                  if x is not None and x.annotation is not None]
        parts += [func.returns] if func.returns is not None else []
    elif isinstance(func, ast.ClassDef):
        parts += func.bases + [k.value for k in func.keywords]
    return parts


def _reads(nodes: list[ast.AST]) -> set[str]:
    return {n.id for root in nodes for n in ast.walk(root) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def free_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names the def reads (body, decorators, defaults, annotations) that neither it
    nor anything inside it binds; its own name counts as bound (recursion)."""
    bound: set[str] = set()
    declared: set[str] = set()
    reads = _reads(_outer_parts(func))
    for stmt in func.body:
        for n in ast.walk(stmt):
            bound |= _bound(n)
            if isinstance(n, (ast.Global, ast.Nonlocal)):
                declared.update(n.names)
        reads |= _reads([stmt])
    bound |= _arg_names(func.args) | {func.name}
    return reads - (bound - declared)


def self_contained(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return free_names(func) <= BUILTINS


def _top_level_bound(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
            out |= {stmt.name} if hasattr(stmt, "name") else _bound(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With, ast.If, ast.Try)):
            for n in ast.walk(stmt):
                if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    out |= _bound(n)
    return out


def plausible(code: str) -> bool:
    """Parses, defines a function at its top level, and each top-level function reads only
    builtins and names the code binds at its top level."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError):
        return False
    funcs = [s for s in tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    known = BUILTINS | _top_level_bound(tree)
    return bool(funcs) and all(free_names(f) <= known for f in funcs)

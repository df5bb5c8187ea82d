"""The sandbox chat templates render in: Jinja's immutable sandbox plus a time and a size budget.

A chat template is code from the model file. Jinja's sandbox keeps it away from Python's
internals but not from burning the machine: two nested `range` loops run for hours,
`'a' * 10**8` builds a string the tokenizer aborts the whole process on, and a loop that
doubles a string eats gigabytes. So every render here carries a Meter with a wall-clock
deadline, and every value the template builds has a size cap:

- each for-loop iteration, call, intercepted operator and `~` checks the deadline (the
  loops get it through a filter the compiler wraps around every `{% for %}` iterable);
- what can amplify is sized BEFORE it runs, so no value grows past the cap: the `*`,
  `+`, `**` and `%` operators, `~`, the str methods that pad, join, replace, translate or
  format, the filters of that kind, and `lipsum`; other calls and `{% set %}` blocks are
  sized after (they can only grow what is already capped by a small factor);
- the output is counted as it is generated.

The deadline lives in the render's own context under a name no template can spell (it
has a dot), so concurrent renders of one compiled template each have their own.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any, Callable, Iterator, Sized

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import generate_lorem_ipsum, pass_context


@dataclass(frozen=True)
class RenderBudget:
    """What one render may spend. Real templates render in milliseconds and write about
    as much text as the messages hold; 3 s leaves room for a slow, busy CPU (the render
    shares the GIL with the decode thread), and 8 Mi characters is more than any context
    we serve holds (about 2M tokens of English). The integer cap keeps `**` from
    building numbers of millions of digits (Python will not even print past 4,300)."""
    seconds: float = 3.0
    max_chars: int = 8 << 20
    max_int_bits: int = 1 << 16


DEFAULT_BUDGET = RenderBudget()


class ChatTemplateError(ValueError, jinja2.TemplateError):
    """A chat template that does not compile, or refused to render these messages.
    A TemplateError too, so code that catches Jinja's errors catches these."""


class TemplateBudgetError(ChatTemplateError):
    """The template ran past its time budget or would build more text than its size budget."""


_METER = "alpha.meter"   # the context key; a dot, so no template can name it
_LOOP, _CONCAT, _SIZED = "alpha.loop", "alpha.concat", "alpha.sized"


class Meter:
    """One render's deadline."""

    def __init__(self, budget: RenderBudget):
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"the chat template ran longer than its budget of "
                                      f"{self.budget.seconds:g} s and was stopped")


def meter_of(context: Context) -> Meter:
    return context[_METER]


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


def _materialize(x: Any) -> Any:
    # Generators (from map/select) are listed so they can be measured and still be used.
    return list(x) if isinstance(x, Iterator) else x


_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")   # "{:>{w}}": a width taken from an argument


def _format_bound(fmt: str, values: list, nested_widths: bool) -> int:
    """Printf- and str.format-style: the text, the str arguments, and every width the
    format can ask for (digits in it; int arguments too where a width can come from one)."""
    widths = [int(d) if len(d) < 12 else 10 ** 12 for d in _DIGITS.findall(fmt)]
    if nested_widths:
        widths += [v for v in values if isinstance(v, int)]
    return len(fmt) + sum(len(v) for v in values if isinstance(v, str)) + max(widths, default=0)


# -- bounds of str methods: (the string, args, kwargs) -> the most characters the call can return
def _pad(s: str, width: int = 0, *_: Any) -> int:
    return max(len(s), width if isinstance(width, int) else 0)


def _join_bound(sep: str, items: Any, *_: Any) -> int:
    n = len(items) if isinstance(items, Sized) else 0
    return sum(_length(x) for x in items) + len(sep) * n if n else 0


def _replace_bound(s: str, old: str = "", new: str = "", count: Any = -1, *_: Any) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * _length(new)


def _translate_bound(s: str, table: Any = None, *_: Any) -> int:
    widest = max((_length(v) for v in table.values()), default=1) if isinstance(table, dict) else 1
    return len(s) * max(widest, 1)


_STR_BOUNDS: dict[str, Callable[..., int]] = {
    "ljust": _pad, "rjust": _pad, "center": _pad, "zfill": _pad,
    "expandtabs": lambda s, tabsize=8, *_: len(s) * max(tabsize if isinstance(tabsize, int) else 8, 1),
    "join": _join_bound, "replace": _replace_bound, "translate": _translate_bound,
}


# -- bounds of filters: (value, args..., kwargs...) -> the most characters or items they return
def _json_depth(v: Any) -> int:
    depth, level = 0, [v]
    while level:
        depth += 1
        level = [c for x in level if isinstance(x, (list, tuple, dict))
                 for c in (x.values() if isinstance(x, dict) else x)]
    return depth


def _tojson_bound(value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> int:
    compact = len(json.dumps(value, default=str))
    width = _length(indent) if isinstance(indent, str) else (indent if isinstance(indent, int) else 0)
    return compact * (1 + max(width, 0) * _json_depth(value))


def _indent_bound(s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    per_line = len(width) if isinstance(width, str) else max(width, 0) if isinstance(width, int) else 4
    text = str(s)
    return len(text) + (text.count("\n") + 1) * per_line


_FILTER_BOUNDS: dict[str, Callable[..., int]] = {
    "join": lambda v, d="", *_a, **_k: _join_bound(str(d), list(v)),
    "center": lambda s, width=80, *_a, **_k: _pad(str(s), width),
    "indent": _indent_bound,
    "replace": lambda s, old="", new="", count=None, **_k: _replace_bound(
        str(s), str(old), str(new), -1 if count is None else count),
    "format": lambda s, *a, **k: _format_bound(str(s), [*a, *k.values()], "*" in str(s)),
    "wordwrap": lambda s, width=79, brk=True, wrapstring=None, *_a, **_k: len(str(s)) * (
        1 + _length(wrapstring or "\n")),
    "slice": lambda v, slices=1, *_a, **_k: _length(v) + 16 * max(slices if isinstance(slices, int) else 1, 0),
    "batch": lambda v, linecount=1, *_a, **_k: _length(v) + max(linecount if isinstance(linecount, int) else 1, 0),
    "tojson": _tojson_bound,
}

_PASS = {"context": lambda c: c, "eval_context": lambda c: c.eval_ctx, "environment": lambda c: c.environment}


class SizedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the budget's checks (the module docstring says which)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, budget: RenderBudget = DEFAULT_BUDGET, filters: dict[str, Callable] | None = None,
                 **options: Any):
        super().__init__(**options)
        self.budget = budget
        self.code_generator_class = _Compiler
        self.filters.update(filters or {})
        self.filters[_LOOP] = _loop
        self.filters[_CONCAT] = _concat
        self.filters[_SIZED] = _sized
        for name, bound in _FILTER_BOUNDS.items():
            if name in self.filters:
                self.filters[name] = _guarded(self.filters[name], bound)

    # -- the checks ---------------------------------------------------------------------
    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.budget.max_chars:
            raise TemplateBudgetError(f"the chat template would build {what} of {n} characters or items, "
                                      f"more than its budget of {self.budget.max_chars}; it was stopped")

    def check_bits(self, bits: int) -> None:
        if bits > self.budget.max_int_bits:
            raise TemplateBudgetError(f"the chat template would build an integer of about {bits} bits, "
                                      f"more than its budget of {self.budget.max_int_bits}; it was stopped")

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The sandbox makes unsafe attributes (__class__, __globals__, ...) an undefined
        # value that prints as ""; refusing outright means a probe cannot pass silently.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    # -- the hooks ----------------------------------------------------------------------
    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        meter_of(context).tick()
        _BINOP_CHECKS[operator](self, left, right)
        result = super().call_binop(context, operator, left, right)
        self.check_size(_length(result))
        return result

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter_of(__context).tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") in _STR_BOUNDS:
            args = tuple(_materialize(a) for a in args)
            __self.check_size(_STR_BOUNDS[__obj.__name__](owner, *args, **kwargs))
        elif __obj is generate_lorem_ipsum:
            n = kwargs.get("n", args[0] if args else 5)
            most = kwargs.get("max", args[3] if len(args) > 3 else 100)
            __self.check_size(12 * n * most if isinstance(n, int) and isinstance(most, int) else 0)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.check_size(_length(result))
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            values = [*args, *kwargs.values()]
            if value.__name__ == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            nested = _NESTED_FIELD.search(text.replace("{{", "")) is not None
            self.check_size(_format_bound(text, values, nested))
            return fmt(*args, **kwargs)
        return update_wrapper(checked, value)


def _check_add(env: SizedSandbox, left: Any, right: Any) -> None:
    env.check_size(_length(left) + _length(right))


def _check_mul(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, int) and not isinstance(right, int):
        left, right = right, left
    if isinstance(right, int):
        if isinstance(left, int):
            env.check_bits(left.bit_length() + right.bit_length())
        else:
            env.check_size(_length(left) * max(right, 0))


def _check_pow(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        env.check_bits(left.bit_length() * right)


def _check_mod(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, str):
        values = list(right.values()) if isinstance(right, dict) else list(right) if isinstance(
            right, tuple) else [right]
        env.check_size(_format_bound(left, values, "*" in left))


_BINOP_CHECKS: dict[str, Callable[[SizedSandbox, Any, Any], None]] = {
    "+": _check_add, "*": _check_mul, "**": _check_pow, "%": _check_mod}


# -- the filters the compiler inserts, and the wrapper of the amplifying ones ----------------
@pass_context
def _loop(context: Context, iterable: Any) -> Iterator[Any]:
    """Every {% for %} iterates through this: the deadline is checked per item."""
    meter = meter_of(context)
    for item in iterable:
        meter.tick()
        yield item


@pass_context
def _concat(context: Context, parts: list) -> str:
    """`a ~ b ~ c`, sized before it is joined."""
    meter_of(context).tick()
    texts = [str(p) for p in parts]
    context.environment.check_size(sum(map(len, texts)), "a string")
    return "".join(texts)


@pass_context
def _sized(context: Context, value: Any) -> Any:
    """The text a `{% set x %}...{% endset %}` block captured."""
    meter_of(context).tick()
    context.environment.check_size(_length(value), "a string")
    return value


def _guarded(f: Callable[..., Any], bound: Callable[..., int]) -> Callable[..., Any]:
    passed = getattr(f, "jinja_pass_arg", None)
    first = _PASS[passed.name] if passed is not None else None

    def run(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        meter_of(context).tick()
        value = _materialize(value)
        env = context.environment
        env.check_size(bound(value, *args, **kwargs))
        result = f(first(context), value, *args, **kwargs) if first else f(value, *args, **kwargs)
        env.check_size(_length(result))
        return result
    return pass_context(update_wrapper(run, f))   # after: update_wrapper copies f's own pass mark


class _Compiler(CodeGenerator):
    """Jinja's code generator, with the budget's filters put into the tree first: around
    every for-loop iterable, every `~`, and every `{% set %}` block's text."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        def wrap(inner: nodes.Expr | None, name: str, lineno: int) -> nodes.Filter:
            return nodes.Filter(inner, name, [], [], None, None, lineno=lineno)
        for loop in list(node.find_all(nodes.For)):
            loop.iter = wrap(loop.iter, _LOOP, loop.lineno)
        for cat in list(node.find_all(nodes.Concat)):
            cat.nodes = [wrap(nodes.List(cat.nodes, lineno=cat.lineno), _CONCAT, cat.lineno)]
        for block in list(node.find_all(nodes.AssignBlock)):
            block.filter = wrap(block.filter, _SIZED, block.lineno)
        super().visit_Template(node, frame)


def render_budgeted(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render (a template of a SizedSandbox) with a fresh deadline, counting the output
    as it is generated."""
    budget = template.environment.budget
    meter = Meter(budget)
    parts, n = [], 0
    for chunk in template.generate({**context, _METER: meter}):
        n += len(chunk)
        if n > budget.max_chars:
            raise TemplateBudgetError(f"the chat template's output passed its budget of {budget.max_chars} "
                                      f"characters and was stopped")
        meter.tick()
        parts.append(chunk)
    return "".join(parts)

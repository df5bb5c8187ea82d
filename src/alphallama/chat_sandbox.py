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
  format, the filters of that kind, and `lipsum` (chat_bounds says how each is sized);
- every other value a template makes is sized as soon as it exists: list, tuple and
  dict literals, call and filter results, `{% set %}` blocks (a value's size counts
  through nested containers, so a list nested in itself 60 times cannot be built);
- the output is counted as it is generated.

The deadline lives in the render's own context under a name no template can spell (it
has a dot), so concurrent renders of one compiled template each have their own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any, Callable, Iterator

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import generate_lorem_ipsum, pass_context
from jinja2.visitor import NodeTransformer

from .chat_bounds import FILTER_BOUNDS, STR_BOUNDS, lipsum_bound, materialize, printf_bound, shallow, size
from .chat_bounds import str_format_bound


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


_PASS = {"context": lambda c: c, "eval_context": lambda c: c.eval_ctx, "environment": lambda c: c.environment}


class SizedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the budget's checks (the module docstring says which). Every
    filter is wrapped: the deadline, its result's size, and for the amplifying ones
    (chat_bounds.FILTER_BOUNDS) the size before it runs."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, budget: RenderBudget = DEFAULT_BUDGET, filters: dict[str, Callable] | None = None,
                 **options: Any):
        super().__init__(**options)
        self.budget = budget
        self.code_generator_class = _Compiler
        self.filters.update(filters or {})
        for name, f in self.filters.items():
            self.filters[name] = _guarded(f, FILTER_BOUNDS.get(name))
        self.filters.update({_LOOP: _loop, _CONCAT: _concat, _SIZED: _sized})

    # -- the checks ---------------------------------------------------------------------
    def check_size(self, n: int, what: str = "a value") -> None:
        if n > self.budget.max_chars:
            raise TemplateBudgetError(f"the chat template would build {what} of {n} characters or items, "
                                      f"more than its budget of {self.budget.max_chars}; it was stopped")

    def check_value(self, value: Any, what: str = "a value") -> None:
        self.check_size(size(value, self.budget.max_chars), what)

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
        self.check_value(result)
        return result

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        meter_of(context).tick()
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str) and getattr(obj, "__name__", "") in STR_BOUNDS:
            args = tuple(materialize(a) for a in args)
            self.check_size(STR_BOUNDS[obj.__name__](owner, *args, **kwargs))
        elif obj is generate_lorem_ipsum:
            self.check_size(lipsum_bound(args, kwargs))
        result = super().call(context, obj, *args, **kwargs)
        self.check_value(result)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            self.check_size(str_format_bound(value.__self__, args, kwargs, value.__name__ == "format_map"))
            return fmt(*args, **kwargs)
        return update_wrapper(checked, value)


def _check_add(env: SizedSandbox, left: Any, right: Any) -> None:
    limit = env.budget.max_chars
    env.check_size(size(left, limit) + size(right, limit))


def _check_mul(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, int) and not isinstance(right, int):
        left, right = right, left
    if isinstance(right, int):
        if isinstance(left, int):
            env.check_bits(left.bit_length() + right.bit_length())
        elif shallow(left) and right > 0:
            env.check_size(size(left, env.budget.max_chars) * right)


def _check_pow(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        env.check_bits(left.bit_length() * right)


def _check_mod(env: SizedSandbox, left: Any, right: Any) -> None:
    if isinstance(left, str):
        env.check_size(printf_bound(left, right))


_BINOP_CHECKS: dict[str, Callable[[SizedSandbox, Any, Any], None]] = {
    "+": _check_add, "*": _check_mul, "**": _check_pow, "%": _check_mod}


# -- the filters the compiler inserts, and the wrapper of every other filter -----------------
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
    """A list, tuple or dict literal, or the text a `{% set x %}...{% endset %}` block captured."""
    meter_of(context).tick()
    context.environment.check_value(value)
    return value


def _guarded(f: Callable[..., Any], bound: Callable[..., int] | None) -> Callable[..., Any]:
    passed = getattr(f, "jinja_pass_arg", None)
    first = _PASS[passed.name] if passed is not None else None

    def run(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        meter_of(context).tick()
        env = context.environment
        if bound is not None:
            value = materialize(value)
            env.check_size(bound(env.budget.max_chars, value, *args, **kwargs))
        result = f(first(context), value, *args, **kwargs) if first else f(value, *args, **kwargs)
        env.check_value(result)
        return result
    return pass_context(update_wrapper(run, f))   # after: update_wrapper copies f's own pass mark


def _wrap(inner: nodes.Expr | None, name: str, lineno: int) -> nodes.Filter:
    return nodes.Filter(inner, name, [], [], None, None, lineno=lineno)


class _Instrument(NodeTransformer):
    """Puts the budget's filters into a parsed template: around every for-loop iterable,
    every `~`, every list, tuple and dict literal, and every `{% set %}` block's text."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _wrap(node.iter, _LOOP, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Concat:
        node = self.generic_visit(node)
        node.nodes = [_wrap(nodes.List(node.nodes, lineno=node.lineno), _CONCAT, node.lineno)]
        return node

    def visit_AssignBlock(self, node: nodes.AssignBlock) -> nodes.AssignBlock:
        node = self.generic_visit(node)
        node.filter = _wrap(node.filter, _SIZED, node.lineno)
        return node

    def _literal(self, node: nodes.Expr) -> nodes.Node:
        node = self.generic_visit(node)
        return _wrap(node, _SIZED, node.lineno) if getattr(node, "ctx", "load") == "load" else node

    visit_List = visit_Tuple = visit_Dict = _literal


class _Compiler(CodeGenerator):
    """Jinja's code generator, run on the instrumented tree."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        super().visit_Template(_Instrument().visit(node), frame)


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

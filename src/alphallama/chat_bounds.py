"""How big a value is, and how big an operation's result can be, before it is built.

chat_sandbox checks these against a render's size budget. A value's `size` is what
printing it would cost: the characters of its strings plus one per item, through nested
lists, tuples and dicts, counting a shared one each time it is reached (a template can
nest one list in itself 60 times with a few lines; printing or comparing that would never
end). The walk stops as soon as it passes the limit, so measuring is never the cost.

The bounds of str methods and filters take the call's own arguments and return the most
characters (or items) the call can produce: a pad width, a separator times the items, a
replacement times its occurrences, the widths a format string asks for.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator, Sized

_CONTAINERS = (list, tuple, dict)   # not range: it is lazy (and capped by the sandbox)


def size(x: Any, limit: int) -> int:
    """Characters plus items, through containers; anything over `limit` may stop early."""
    if isinstance(x, str):
        return len(x)
    total, todo = 0, [x]
    while todo and total <= limit:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, _CONTAINERS):
            total += len(v)
            if total <= limit:
                todo.extend(v.items() if isinstance(v, dict) else v)
    return total


def shallow(x: Any) -> int:
    return len(x) if isinstance(x, (str, *_CONTAINERS)) else 0


def materialize(x: Any) -> Any:
    """Generators (from map/select) as lists, so they can be measured and still be used."""
    return list(x) if isinstance(x, Iterator) else x


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) else default


_DIGITS = re.compile(r"\d+")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")   # "{:>{w}}": a width taken from an argument


def format_bound(fmt: str, values: list, widths_from_args: bool) -> int:
    """Printf- and str.format-style: the text, the str arguments, and every width the
    format can ask for (digits in it; int arguments too where a width can come from one)."""
    widths = [int(d) if len(d) < 12 else 10 ** 12 for d in _DIGITS.findall(fmt)]
    if widths_from_args:
        widths += [v for v in values if isinstance(v, int)]
    return len(fmt) + sum(len(v) for v in values if isinstance(v, str)) + max(widths, default=0)


def str_format_bound(fmt: str, args: tuple, kwargs: dict, is_map: bool) -> int:
    values = list(args[0].values()) if is_map and args and isinstance(args[0], dict) else [*args, *kwargs.values()]
    return format_bound(fmt, values, _NESTED_FIELD.search(fmt.replace("{{", "")) is not None)


def printf_bound(fmt: str, right: Any) -> int:
    values = list(right.values()) if isinstance(right, dict) else list(right) if isinstance(right, tuple) else [right]
    return format_bound(fmt, values, "*" in fmt)


# -- str methods: (the string, args...) -> the most characters the call returns -------------
def _pad(s: str, width: Any = 0, *_: Any) -> int:
    return max(len(s), _int(width, 0))


def _join(sep: str, items: Any, *_: Any) -> int:
    n = len(items) if isinstance(items, Sized) else 0
    return sum(shallow(x) for x in items) + len(sep) * n if n else 0


def _replace(s: str, old: str = "", new: str = "", count: Any = -1, *_: Any) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * shallow(new)


def _translate(s: str, table: Any = None, *_: Any) -> int:
    widest = max((shallow(v) for v in table.values()), default=1) if isinstance(table, dict) else 1
    return len(s) * max(widest, 1)


def _expandtabs(s: str, tabsize: Any = 8, *_: Any) -> int:
    return len(s) * max(_int(tabsize, 8), 1)


STR_BOUNDS: dict[str, Callable[..., int]] = {
    "ljust": _pad, "rjust": _pad, "center": _pad, "zfill": _pad, "expandtabs": _expandtabs,
    "join": _join, "replace": _replace, "translate": _translate,
}


# -- filters: (limit, value, args..., kwargs...) -> the most characters or items they return
def _depth(v: Any) -> int:
    """Nesting depth (of a value whose size is within the limit: the walk is that long)."""
    depth, level = 0, [v]
    while level:
        depth += 1
        level = [c for x in level if isinstance(x, (list, tuple, dict))
                 for c in (x.values() if isinstance(x, dict) else x)]
    return depth


def _tojson(limit: int, value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> int:
    # The dump of a value within the budget is a few times its size at most (escapes,
    # quotes, commas; the result is checked too), but an indent repeats per line and level.
    n = size(value, limit)
    width = len(indent) if isinstance(indent, str) else max(_int(indent, 0), 0)
    return n * (1 + width * _depth(value)) if width and n <= limit else n


def _indent(limit: int, s: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    per_line = len(width) if isinstance(width, str) else max(_int(width, 4), 0)
    text = str(s)
    return len(text) + (text.count("\n") + 1) * per_line


def _filter_join(limit: int, value: Any, d: Any = "", *_: Any, **__: Any) -> int:
    return _join(str(d), list(value))


def _filter_replace(limit: int, s: Any, old: Any = "", new: Any = "", count: Any = None, *_: Any, **__: Any) -> int:
    return _replace(str(s), str(old), str(new), -1 if count is None else count)


def _wordwrap(limit: int, s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
              *_: Any, **__: Any) -> int:
    return len(str(s)) * (1 + shallow(wrapstring or "\n"))


FILTER_BOUNDS: dict[str, Callable[..., int]] = {
    "join": _filter_join,
    "center": lambda _, s, width=80, *_a, **_k: _pad(str(s), width),
    "indent": _indent,
    "replace": _filter_replace,
    "format": lambda _, s, *a, **k: format_bound(str(s), [*a, *k.values()], "*" in str(s)),
    "wordwrap": _wordwrap,
    "slice": lambda _, v, slices=1, *_a, **_k: shallow(v) + 16 * max(_int(slices, 1), 0),
    "batch": lambda _, v, linecount=1, *_a, **_k: shallow(v) + max(_int(linecount, 1), 0),
    "tojson": _tojson,
}


def lipsum_bound(args: tuple, kwargs: dict) -> int:
    """generate_lorem_ipsum(n=5, html=True, min=20, max=100): n paragraphs of up to max words."""
    n = kwargs.get("n", args[0] if args else 5)
    most = kwargs.get("max", args[3] if len(args) > 3 else 100)
    return 12 * _int(n, 0) * _int(most, 0)

"""names.py: the free names of a function, worked out by hand, and 'plausible' on the
shipped model's real answers (bench/results/embedded-edits-20261203.json)."""
from __future__ import annotations

import ast
import builtins
import subprocess
import sys
import textwrap

import pytest

from alphallama.train.names import free_names, plausible, self_contained


def _fn(src: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(src)).body[-1]


@pytest.mark.parametrize("src, free", [
    ("def f(a, *b, c=1, **d):\n    return a, b, c, d, len(b)", {"len"}),
    ("def f(x):\n    y = x + Z\n    return y", {"Z"}),
    ("def f(x):\n    import os.path as p, sys\n    from json import dumps as j\n    return p, sys, j(x)", set()),
    ("def f(x):\n    return [i for i in x if i] + list(map(lambda q: q * K, x))", {"list", "map", "K"}),
    (("def f(x):\n    for i, (j, k) in x:\n        pass\n    with open(x) as fh:\n        pass\n"
      "    try:\n        pass\n    except ValueError as e:\n        raise e\n    return i, j, k, fh"),
     {"open", "ValueError"}),
    ("def f(x):\n    def g(y=x):\n        return y + w\n    w = 1\n    return g()", set()),
    ("def f(x):\n    global G\n    G = x\n    return G", {"G"}),
    ("def f(x):\n    return f(x - 1) if x else 0", set()),                     # recursion
    ("@functools.cache\ndef f(x: np.ndarray = DEFAULT) -> Out:\n    return x", {"functools", "np", "DEFAULT", "Out"}),
    (("def f(x):\n    match x:\n        case {'a': a, **rest}:\n            return a, rest\n"
      "        case [b, *cs]:\n            return b, cs\n        case C(d=e) as m:\n            return e, m"), {"C"}),
    ("def f(x):\n    if (n := len(x)) > 1:\n        return n\n    class K:\n        pass\n    return K", {"len"}),
])
def test_free_names_by_hand(src, free):
    f = _fn(src)
    assert free_names(f) == free
    assert self_contained(f) == (free <= set(dir(builtins)))


def test_free_names_agree_with_python():
    """Running each self-contained function body alone raises no NameError; one with a
    free non-builtin name does (an independent check: the interpreter's own scoping)."""
    cases = {"def f(x):\n    import math\n    return [math.sqrt(v) for v in range(x)]\nf(3)": True,
             "def f(x):\n    return [v for v in range(x) if v in _SEEN]\nf(3)": False,
             "def f(x):\n    y = x * 2\n    return sorted({y, x})\nf(3)": True,
             "def f(x):\n    return helper(x)\nf(3)": False}
    for code, ok in cases.items():
        assert self_contained(ast.parse(code).body[0]) == ok
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert (r.returncode == 0) == ok and (ok or "NameError" in r.stderr)


def test_plausible_on_answers():
    assert plausible("def rev(s):\n    return s[::-1]")
    assert plausible("import os\n\n\ndef py(root):\n    return [p for p in os.listdir(root) if p.endswith('.py')]")
    assert plausible("from math import prod\n\ndef fact(n):\n    return prod(range(1, n + 1))")
    assert plausible("LIMIT = 3\n\ndef f(n):\n    return min(n, LIMIT)")
    # the shipped model's answers: parse and define a function, but read names that do not exist
    assert not plausible('def _is_palindrome():\n    """Return True."""\n    if _is_palindrome(_palindrome):\n'
                         '        return _palindrome')
    assert not plausible("def f(name):\n    if name in _PROGRESSORS:\n        return 1")
    assert not plausible("x = 1\n") and not plausible("def reverses a string.\n")

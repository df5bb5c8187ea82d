"""The plain-language code-writing requests (requests.py), the function pool that asks
for every corpus function once before any twice, the kind weights of the example mix,
and the tokenizer-independent quality measures of the evaluation (quality.py)."""
from __future__ import annotations

import math
import random
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch

from alphallama.train.instruct import (
    N_STYLES,
    FunctionPool,
    check_write_function,
    function_cases,
    make_examples,
    write_function_edit,
)
from alphallama.train.names import plausible
from alphallama.train.quality import (
    answer_code,
    defines_function,
    heldout_bits_per_byte,
    repeat_share,
)
from alphallama.train.requests import PHRASINGS, request, summary, verb_forms

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.mark.parametrize("sentence, forms", [
    ("Return the sum of x", ("returns the sum of x", "return the sum of x")),
    ("Returns the sum of x", ("returns the sum of x", "return the sum of x")),
    ("Process a batch", ("processes a batch", "process a batch")),
    ("Processes a batch", ("processes a batch", "process a batch")),
    ("Apply f to every item", ("applies f to every item", "apply f to every item")),
    ("Copies the file", ("copies the file", "copy the file")),
    ("Fetch one row", ("fetches one row", "fetch one row")),
    ("The sum of x", None), ("Helper for sorting", None), ("TIFF images", None), ("Return", None),
])
def test_verb_forms_by_hand(sentence, forms):
    assert verb_forms(sentence) == forms


def test_summary_and_request():
    doc = "Return the paths of all .py files\n    under root.  Hidden ones too.\n\nMore text."
    assert summary(doc) == "Return the paths of all .py files under root"
    assert summary(":param x: the value") is None and summary(">>> f(1)\n2") is None and summary("Short.") is None
    s = summary(doc)
    assert request("py_files", "py_files(root)", s, 0) == \
        "Write a Python function that returns the paths of all .py files under root."
    assert request("py_files", "py_files(root)", s, 1) == \
        "Write a Python function to return the paths of all .py files under root."
    assert request("f", "f()", "The thing", 0) is None      # no verb to phrase
    assert request("f", "f()", "The thing", 7) == "Create a function `f`: The thing."


def test_function_cases_skip_stubs_and_mark_methods():
    text = ('class A:\n    def f(self):\n        """Return x."""\n        raise NotImplementedError\n\n'
            '    def g(self, y):\n        """Return y doubled."""\n        z = y * 2\n        return z\n\n'
            'async def k(a):\n    """Return a plus one."""\n    b = a + 1\n    return b\n')
    cases = {c.name: c for c in function_cases(text)}
    assert sorted(cases) == ["g", "k"] and cases["g"].method and not cases["k"].method
    assert cases["k"].src.startswith("async def k(a):")
    header = write_function_edit(cases["k"], N_STYLES - 1).prompt
    assert "```python\nasync def k(a):\n" in header
    assert write_function_edit(cases["g"], 0) is None        # a method is not asked for as a function
    edits = [e for s in range(N_STYLES) if (e := write_function_edit(cases["k"], s)) is not None]
    assert len(edits) == N_STYLES and len({e.prompt for e in edits}) == N_STYLES
    assert all(check_write_function(e) for e in edits)


def test_pool_asks_closed_functions_first_each_once_before_any_twice():
    texts = [(STDLIB / f).read_text() for f in ("textwrap.py", "shlex.py", "glob.py", "calendar.py", "heapq.py")]
    cases = [c for t in texts for c in function_cases(t)]
    n_closed = sum(c.closed for c in cases)
    assert 0 < n_closed < len(cases)
    pool = FunctionPool(texts, random.Random(0), 1400)
    got = []
    while (e := pool.next()) is not None:
        got.append(e)
    assert all(check_write_function(e) for e in got)
    assert len({(e.output, e.prompt) for e in got}) == len(got)        # no (function, style) twice
    closed = {c.answer for c in cases if c.closed}
    kinds = [e.output in closed for e in got]
    first_open = kinds.index(False)
    assert all(kinds[:first_open]) and not any(kinds[first_open:])    # every closed request first
    assert len({e.output for e in got[:n_closed]}) == n_closed          # each closed function once ...
    n_open = len(cases) - n_closed
    assert len({e.output for e in got[first_open:first_open + n_open]}) == n_open   # ... and each other
    plain = sum(not e.prompt.startswith(("Write a Python function `", "Complete this")) for e in got[:n_closed])
    can = sum(any(write_function_edit(c, s) for s in range(len(PHRASINGS))) for c in cases if c.closed)
    assert plain == can > 0            # plain-language requests come first where they fit


def test_function_cases_bring_their_imports():
    text = ("import os\nimport numpy as np\nfrom typing import Any, List\nfrom . import sibling\nLIMIT = 3\n\n\n"
            "def a(p):\n    \"\"\"Return the base name of p.\"\"\"\n    q = os.path.basename(p)\n    return q\n\n\n"
            "def b(xs: List[int]) -> Any:\n    \"\"\"Return the array of xs.\"\"\"\n    out = np.array(xs)\n    return out\n\n\n"
            "def c(n):\n    \"\"\"Return n below the limit.\"\"\"\n    m = min(n, LIMIT)\n    return m\n\n\n"
            "def d(n):\n    \"\"\"Return the sibling of n.\"\"\"\n    s = sibling(n)\n    return s\n\n\n"
            "def e(n):\n    \"\"\"Return n squared plus one.\"\"\"\n    import math\n    return math.pow(n, 2) + 1\n")
    cases = {c.name: c for c in function_cases(text)}
    assert cases["a"].closed and cases["a"].imports == "import os"
    assert cases["a"].answer.startswith("import os\n\n\ndef a(p):")
    assert cases["b"].closed and cases["b"].imports == "import numpy as np\nfrom typing import Any, List"
    assert not cases["c"].closed and cases["c"].imports == "" and cases["c"].answer == cases["c"].src   # a global
    assert not cases["d"].closed                                       # a relative import
    assert cases["e"].closed and cases["e"].imports == ""              # imports inside
    for c in cases.values():
        assert plausible(c.answer) == c.closed
        e = write_function_edit(c, len(PHRASINGS))
        assert check_write_function(e) and e.answer.startswith("```python\n" + c.answer[:10])


def test_kind_weights_set_the_mix():
    texts = [(STDLIB / f).read_text() for f in ("textwrap.py", "shlex.py", "calendar.py", "heapq.py", "csv.py")]
    ex = make_examples(texts, 60, seed=2, kinds=("quotes", "csv_sort", "write_function"), weights={"write_function": 4})
    assert Counter(e.kind for e in ex) == {"write_function": 40, "quotes": 10, "csv_sort": 10}


def test_repeat_share_and_code_checks_by_hand():
    assert repeat_share("a b c d e f g h") == 0.0
    # 13 words, 8 windows of 6: the last one ("a".."f" again) repeats the first
    assert repeat_share("a b c d e f x a b c d e f", n=6) == round(1 / 8, 3)
    assert repeat_share("x " * 40) == round(34 / 35, 3)
    answer = "Here:\n```python\ndef f(x):\n    return x\n```\ntrailing"
    assert answer_code(answer) == "def f(x):\n    return x" and defines_function(answer_code(answer))
    assert answer_code("```python\ndef f(x):\n    return x") == "def f(x):\n    return x"   # unclosed
    assert not defines_function("def reverses a string.\n") and not defines_function("x = 1\n")


class _Uniform:
    """An engine stand-in whose model gives every token the same logit."""
    ctx_size, V = 8, 50

    class _Tok:
        def decode(self, ids):
            return "".join("ab"[i % 2] * (1 + i % 3) for i in ids)

    def __init__(self):
        self.tokenizer = self._Tok()
        self.cache = None
        outer = self

        class _M:
            def forward(self, tokens, pos, cache):
                return torch.zeros(tokens.shape[0], outer.V), None
        self.model = _M()

    def encode_prompt(self, text):
        return [ord(c) % self.V for c in text]

    def reset(self):
        pass


def test_bits_per_byte_of_a_uniform_model():
    eng = _Uniform()
    texts = ["hello world, long enough", "xyz"]
    r = heldout_bits_per_byte(eng, texts, windows=2)
    n_bytes = sum(len(eng.tokenizer.decode(eng.encode_prompt(t)[:8][1:]).encode()) for t in texts)
    n_tok = 7 + 2
    assert r["tokens"] == n_tok and r["bytes"] == n_bytes
    assert r["bits_per_byte"] == pytest.approx(n_tok * math.log2(50) / n_bytes, abs=1e-4)
    assert r["nats_per_token"] == pytest.approx(math.log(50), abs=1e-4)

"""Sequence-level distillation data: the filter on a coder model's answers (teach_answers.judge),
`python -m alphallama.train.teach` end to end on the CPU with the embedded model standing in
for the teacher, and the data builder putting the answers into the student's examples."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import random
import shutil
import sysconfig
import time
from pathlib import Path

import pytest

from alphallama.config import DEFAULTS
from alphallama.train import teach
from alphallama.train.data import rendered_examples
from alphallama.train.instruct import TEACHER_KIND, FunctionPool, make_examples, make_template
from alphallama.train.names import plausible
from alphallama.train.pipeline import add_arguments, build_data, data_key, load_data_cache, teacher_meta
from alphallama.train.quality import answer_code, defines_function
from alphallama.train.teach_answers import judge, read_answers, summary_path, write_answers

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE_FILES = ["textwrap.py", "fnmatch.py", "bisect.py", "colorsys.py", "filecmp.py", "shlex.py",
                "glob.py", "calendar.py", "csv.py", "heapq.py", "pprint.py", "string.py"]
EMBEDDED = Path(__file__).resolve().parents[2] / "src/alphallama/data/alphallama-embedded.gguf"
pytestmark = pytest.mark.usefixtures("one_thread")   # the stand-in teacher: a tiny model on a shared CPU


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src")
    for f in SAMPLE_FILES:
        if (STDLIB / f).exists():
            shutil.copy(STDLIB / f, d / f)
    return d


@pytest.fixture(scope="module")
def texts(root) -> list[str]:
    return [p.read_text() for p in sorted(root.iterdir())]


def _fenced(code: str, before: str = "Here is the function:\n\n", after: str = "\n\nIt works.") -> str:
    return f"{before}```python\n{code}\n```{after}"


def test_filter_keeps_plausible_functions_with_their_imports():
    kept, why = judge(_fenced('def reverse(s):\n    """Reverse s."""\n    return s[::-1]\n\n\nprint(reverse("ab"))'))
    assert why == "kept" and kept == '```python\ndef reverse(s):\n    """Reverse s."""\n    return s[::-1]\n```'
    code = ("import math\nfrom typing import List\n\n\ndef norm(xs: List[float]) -> float:\n"
            "    return math.sqrt(sum(x * x for x in xs))\n\n\ndef unit(xs):\n    n = norm(xs)\n"
            "    return [x / n for x in xs]")
    kept, why = judge(_fenced(code + "\n\n# Example usage\nv = [3.0, 4.0]\nprint(unit(v))"))
    assert why == "kept" and answer_code(kept) == code          # imports first, both functions, no example
    kept, why = judge(_fenced("from typing import *\nimport os, sys\n\ndef here():\n    return os.getcwd()"))
    assert answer_code(kept) == "import os\n\n\ndef here():\n    return os.getcwd()"   # only what it reads
    kept, why = judge("def f(x):\n    return x + 1\n")              # unfenced code is its own code
    assert why == "kept" and answer_code(kept) == "def f(x):\n    return x + 1"


@pytest.mark.parametrize("text, reason", [
    (_fenced("def f(x):\n    return helper(x) + LIMIT"), "invented names"),
    (_fenced("VOWELS = 'aeiou'\n\ndef count(s):\n    return sum(c in VOWELS for c in s)"), "invented names"),
    (_fenced("def f(x)\n    return x"), "syntax"),
    (_fenced("def f(x):\n    return (x"), "syntax"),
    ("Sure! You can reverse a string with slicing.", "syntax"),
    (_fenced("x = [1, 2, 3]\nprint(sorted(x))"), "no function"),
    (_fenced('def f(x):\n    """Do it."""\n    pass'), "stub"),
    (_fenced("from .util import helper\n\ndef f(x):\n    return helper(x)"), "relative import"),
])
def test_filter_drops_invented_names_syntax_errors_and_stubs(text, reason):
    assert judge(text) == (None, reason)


def test_answers_file_round_trips(tmp_path):
    rows = [("Write a Python function that adds one.", "```python\ndef add_one(x):\n    return x + 1\n```"),
            ("Напиши функцию", "```python\ndef f():\n    return 'ж'\n```")]
    p = tmp_path / "answers.jsonl.gz"
    assert write_answers(p, rows) == 2
    first = p.read_bytes()
    assert read_answers(p) == rows
    write_answers(p, rows)
    assert p.read_bytes() == first                                  # the same answers, the same bytes
    assert summary_path(p) == tmp_path / "answers.summary.json"
    p.write_bytes(gzip.compress(b'{"request": "q"}\n'))
    with pytest.raises(ValueError, match="answers.jsonl.gz:1"):
        read_answers(p)


def _teach(root: Path, out: Path, *extra: str) -> dict:
    args = teach.parse_args([str(EMBEDDED), "-o", str(out), "--root", f"lib={root}", "--corpus-mb", "2",
                             "--workers", "0", "--device", "cpu", "--max-new", "16", *extra])
    return teach.run(args)


def _check_file(out: Path, summary: dict) -> list[dict]:
    lines = [json.loads(x) for x in gzip.open(out, "rt")]
    assert summary == json.loads(summary_path(out).read_text())
    assert len(lines) == summary["kept"] and summary["kept"] <= summary["finished"] <= summary["answered"]
    for row in lines:
        assert set(row) == {"request", "answer"} and row["request"]
        assert judge(row["answer"]) == (row["answer"], "kept")         # the kept answer, as the filter writes it
        code = answer_code(row["answer"])
        assert defines_function(code) and plausible(code)
    return lines


@pytest.mark.skipif(not EMBEDDED.exists(), reason="the embedded model is not in the tree")
def test_teach_end_to_end_with_a_stand_in_teacher(root, tmp_path, monkeypatch):
    out = tmp_path / "answers.jsonl.gz"
    s = _teach(root, out, "--requests", "4", "--batch", "4")
    _check_file(out, s)
    assert s["requests"] == 4 and s["answered"] == 4 and not s["stopped_by_deadline"]
    assert s["teacher"] == EMBEDDED.name and len(s["teacher_sha256"]) == 64
    assert sum(s["reasons"].values()) == 4                          # every answer judged or cut at --max-new
    texts = [p.read_text() for p in sorted(root.iterdir())]
    pool = FunctionPool(texts, random.Random(0), 1400)
    asked = set(iter(lambda: getattr(pool.next(), "prompt", None), None))
    made = teach.make_requests(texts, 40, 0)
    assert len(made) == len(set(made)) == 40 and set(made) <= asked   # requests as the training data asks them

    # the deadline stops generation between batches, and what was answered is written: a
    # clock that jumps past the deadline once the first batch is logged
    jump = [0.0]
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + jump[0])
    monkeypatch.setattr(teach, "log", lambda msg: jump.__setitem__(0, jump[0] + 1e4 * msg.startswith("generate:")))
    out2 = tmp_path / "cut.jsonl.gz"
    s = _teach(root, out2, "--requests", "4", "--batch", "1", "--deadline-s", "600")
    _check_file(out2, s)
    assert s["answered"] == 1 and s["unreached"] == 3 and s["stopped_by_deadline"]

    # SIGTERM finishes the batch and writes what was answered (a cut CPU run keeps its work)
    monkeypatch.setattr(time, "monotonic", real)
    monkeypatch.setattr(teach, "log", lambda msg: msg.startswith("generate:") and os.kill(os.getpid(), signal.SIGTERM))
    out3 = tmp_path / "signalled.jsonl.gz"
    s = _teach(root, out3, "--requests", "4", "--batch", "1")
    _check_file(out3, s)
    assert s["answered"] == 1 and s["unreached"] == 3 and s["stopped_by_signal"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handler is gone after generation


def _answers(texts: list[str], k: int) -> list[tuple[str, str]]:
    """k requests the student's own pool asks, each with a hand-made plausible answer."""
    pool = [e.prompt for e in make_examples(texts, 4 * k, seed=5, kinds=("write_function",))]
    return [(q, f"```python\ndef answer_{i}(x):\n    return x + {i}\n```") for i, q in enumerate(pool[:k])]


def test_teacher_answers_go_into_the_students_examples(texts):
    answers = _answers(texts, 3)
    ex = rendered_examples(texts, 26, seed=1, weights={"write_function": 6}, teacher=answers)
    got = [t for k, t in ex if k == TEACHER_KIND]
    assert len(got) == 3 and len(ex) == 26
    tmpl = make_template()
    for q, a in answers:
        turn = tmpl.render([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                           add_generation_prompt=False)
        assert sum(turn.split("<|im_start|>user")[1] in t for t in got) == 1   # the student's template
        assert sum(f"<|im_start|>user\n{q}<|im_end|>" in t for _, t in ex) == 1  # never also with the corpus answer
    # a share: the teacher answers that share of the code-writing requests (12 of 26 here)
    many = _answers(texts, 10)
    ex = rendered_examples(texts, 26, seed=1, weights={"write_function": 6}, teacher=many, teacher_share=0.25)
    assert sum(k == TEACHER_KIND for k, _ in ex) == 3 and sum(k.startswith("write_function") for k, _ in ex) == 12
    ex = rendered_examples(texts, 26, seed=1, weights={"write_function": 6}, teacher=many, teacher_share=0.0)
    assert not any(k == TEACHER_KIND for k, _ in ex)
    assert not any(f"<|im_start|>user\n{q}<|im_end|>" in t for q, _ in many for _, t in ex)


def _args(root: Path, answers: Path | None, **kw) -> argparse.Namespace:
    a = dict(corpus_mb=2, instruct_examples=26, write_function_weight=6, vocab_size=400, seed=0,
             root=[f"lib={root}"], tokenizer_sample_mb=1, workers=1, teacher_answers=answers and str(answers),
             teacher_share=None, teacher_repeat=1)
    return argparse.Namespace(**(a | kw))


def test_data_builder_records_the_answers_and_keys_the_cache(root, texts, tmp_path):
    ans = tmp_path / "answers.jsonl.gz"
    write_answers(ans, _answers(texts, 3))
    (summary_path(ans)).write_text(json.dumps({"teacher": "coder.gguf", "teacher_sha256": "ab" * 32}))
    work = tmp_path / "work"
    work.mkdir()
    args = _args(root, ans)
    d = build_data(args, work, {})
    rec = d["corpus"]["teacher"]
    assert rec["used"] == 3 == d["corpus"]["examples"][TEACHER_KIND] and rec["answers"] == 3
    assert rec["file"] == "answers.jsonl.gz" and rec["teacher"] == "coder.gguf"
    meta = teacher_meta(rec)
    assert meta["alphallama.training.teacher_answers"] == 3
    assert meta["alphallama.training.teacher_answers_sha256"] == rec["sha256"] \
        == data_key(args)["teacher_answers_sha256"]
    assert meta["alphallama.training.teacher_model"] == "coder.gguf" and teacher_meta(None) == {}
    assert load_data_cache(work / "data.pt", data_key(args)) is not None      # cached under its key ...
    other = tmp_path / "other.jsonl.gz"
    write_answers(other, _answers(texts, 2))
    for changed in (_args(root, other), _args(root, None), _args(root, ans, teacher_share=0.5),
                    _args(root, ans, teacher_repeat=2)):
        assert data_key(changed) != data_key(args)                             # ... which the answers change
        assert load_data_cache(work / "data.pt", data_key(changed)) is None
    (tmp_path / "work2").mkdir()
    twice = build_data(_args(root, ans, teacher_repeat=2), tmp_path / "work2", {})   # each answer twice
    rec2 = twice["corpus"]["teacher"]
    assert (rec2["answers"], rec2["used"], rec2["repeat"]) == (3, 6, 2) == (3, twice["corpus"]["examples"][TEACHER_KIND], 2)
    assert teacher_meta(rec2)["alphallama.training.teacher_repeat"] == 2


def test_device_script_runs_teach_with_flags_that_exist():
    """bench/gpu_train_embedded.sh's TEACHER step (smoked on the CPU: its header) calls teach
    and the trainer with flags they have."""
    text = (Path(__file__).resolve().parents[2] / "bench" / "gpu_train_embedded.sh").read_text()
    for flag in ("python3 -m alphallama.train.teach", "--requests", "--deadline-s", "--device",
                 "--teacher-answers", "TEACHER=src/alphallama/data/alphallama-embedded.gguf"):
        assert flag in text
    args = teach.parse_args([str(EMBEDDED), "-o", "a.jsonl.gz", "--requests", "8", "--deadline-s", "150",
                             "--device", "cpu", "--corpus-mb", "2", "--seed", "1", "--root", "lib=/x",
                             "--max-new", "32", "--workers", "1", "--batch", "512"])
    assert (args.requests, args.deadline_s, args.batch) == (8, 150.0, 512)
    p = argparse.ArgumentParser()
    add_arguments(p, DEFAULTS.train)
    a = p.parse_args(["--out", "o", "--teacher-answers", "a.jsonl.gz", "--teacher-share", "0.5"])
    assert (a.teacher_answers, a.teacher_share) == ("a.jsonl.gz", 0.5)
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "o", "--teacher-share", "1.5"])

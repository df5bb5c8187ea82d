"""Corpus selection, the instruction generators (each edit checked by a program), and the
tokenizer the embedded model stores (round trip through our own Tokenizer)."""
from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest

from alphallama.tokenizer import Tokenizer
from alphallama.train.bpe import SPECIALS, gguf_tokenizer_kv, metadata_dict, train_bpe
from alphallama.train.corpus import collect, held_out, read_manifest, write_manifest
from alphallama.train.edits import TASKS, Edit, check_remove_comments, check_rename, make_remove_comments, make_rename
from alphallama.train.instruct import (KINDS, chat_template_text, check_write_function, make_examples,
                                       make_template, render)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE_FILES = ["textwrap.py", "fnmatch.py", "bisect.py", "colorsys.py", "filecmp.py", "shlex.py",
                "glob.py", "calendar.py", "csv.py", "heapq.py", "pprint.py", "string.py"]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [(STDLIB / f).read_text() for f in SAMPLE_FILES if (STDLIB / f).exists()]


def _write(root: Path, rel: str, text: str | bytes) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(text if isinstance(text, bytes) else text.encode())


def test_corpus_excludes_dedups_and_manifests(tmp_path):
    site, lib = tmp_path / "site", tmp_path / "lib"
    body = "def f(x):\n    return x + N\n" * 4
    _write(site, "pkg/a.py", body.replace('N', '1'))
    _write(site, "pkg/copy_of_a.py", body.replace('N', '1'))               # duplicate content
    _write(site, "pkg/b.py", body.replace('N', '2'))
    for name in ("docker/api.py", "jedi/x.py", "moto/core/y.py", "boto3/s.py", "itsdangerous/z.py",
                 "vendor/jmespath/p.py", "jmespath.py"):
        _write(site, name, body.replace('N', str(len(name))))
    _write(site, "pkg/latin1.py", "x = '\xe9'\n".encode("latin-1") * 20)   # not UTF-8
    _write(site, "pkg/data.txt", body.replace('N', '3'))
    _write(lib, "os_like.py", body.replace('N', '4'))
    _write(lib, "site-packages/pkg/a.py", body.replace('N', '5'))          # seen from the stdlib root: skipped
    files = collect([("site", site), ("lib", lib)], held_out_fraction=0.5)
    paths = sorted(f.path for f in files)
    assert paths == ["lib/os_like.py", "site/pkg/a.py", "site/pkg/b.py"]
    assert len({f.sha256 for f in files}) == len(files)
    for f in files:
        assert f.held_out == held_out(f.sha256, 0.5)
    sha = write_manifest(files, tmp_path / "m.tsv.gz")
    assert sha == write_manifest(files, tmp_path / "m2.tsv.gz")    # same corpus, same bytes
    rows = read_manifest(tmp_path / "m.tsv.gz")
    assert [(r["path"], r["sha256"], r["split"]) for r in rows] == \
        [(f.path, f.sha256, "heldout" if f.held_out else "train") for f in files]


def test_held_out_split_is_by_hash():
    import hashlib
    shas = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4000)]
    share = sum(held_out(s, 0.02) for s in shas) / len(shas)
    assert 0.01 < share < 0.03


@pytest.mark.parametrize("kind", KINDS)
def test_every_generator_output_passes_its_checker(kind, texts):
    ex = make_examples(texts, 12, seed=3, kinds=(kind,))
    assert len(ex) == 12
    check = check_write_function if kind == "write_function" else TASKS[kind].check
    for e in ex:
        assert check(e), (e.prompt, e.output)
        if kind not in ("unchanged", "write_function"):
            assert e.output != e.source
        broken = Edit(e.kind, e.prompt, e.source, e.output.replace("\n", "\n\n", 1) + "x", e.params)
        assert not check(broken)      # a checker is no rubber stamp


def test_rename_and_comment_removal_by_hand():
    src = "def add(a, b):  # sum\n    # doc\n    return a + b  # done\n\n\nx = add(1, 2)  # call add\ns = 'add'\n"
    e = make_rename(src, random.Random(0))
    old, new = e.params["old"], e.params["new"]
    assert e.output == src.replace(f"{old}(", f"{new}(").replace(f"def {old}", f"def {new}") or old != "add"
    if old == "add":
        assert "s = 'add'" in e.output and "# call add" in e.output    # strings and comments stay
    assert check_rename(e)
    c = make_remove_comments(src, random.Random(0))
    assert c.output == "def add(a, b):\n    return a + b\n\n\nx = add(1, 2)\ns = 'add'\n"
    assert check_remove_comments(c)


def test_chatml_rendering(texts):
    e = make_examples(texts, 1, seed=0, kinds=("csv_sort",))[0]
    text = render(e, make_template())
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n")
    assert f"<|im_start|>user\n{e.prompt}<|im_end|>\n<|im_start|>assistant\n{e.answer}<|im_end|>" in text


def test_tokenizer_round_trip_through_our_tokenizer(tmp_path, texts):
    from gguf import GGUFWriter
    hf = train_bpe(texts, 1200)
    kv = gguf_tokenizer_kv(hf, chat_template_text())
    path = tmp_path / "tok.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    for k, v, t, sub in kv:
        w.add_key_value(k, v, t, sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_gguf(path)
    assert ours.vocab_size == hf.get_vocab_size() == 1200
    assert [ours.id_of(s) for s in SPECIALS] == [hf.token_to_id(s) for s in SPECIALS]
    chat = render(make_examples(texts, 1, seed=1, kinds=("rename",))[0], make_template())
    for text in [t[:4000] for t in texts] + [chat, "naïve café — ünïcode 😀\n\t x=1"]:
        ids = hf.encode(text).ids
        assert ours.encode(text, parse_special=True) == ids
        assert ours.decode(ids) == text
    assert ours.eos_id == hf.token_to_id("<|im_end|>") and ours.is_stop(hf.token_to_id("<|endoftext|>"))
    assert metadata_dict(kv)["tokenizer.ggml.pre"] == "qwen2"

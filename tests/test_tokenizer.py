"""The tokenizer against llama.cpp: its test-tokenizer-0 vectors, the reference runs of
two real models, and an independent re-implementation of its SPM merge loop."""
from __future__ import annotations

import heapq
import json
import random
import time
from pathlib import Path

import pytest

from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.tokenizer import (TokenType, Tokenizer, hf_pre_tokenizer, known_pre_tokenizers,
                                   pre_tokenizer)

from conftest import QWEN, REFERENCE, STORIES, vocab_path

shared = pytest.mark.shared   # the qwen2 and llama-bpe vocabularies are in ../shared only (tests/conftest.py)
VOCABS = (pytest.param("qwen2", marks=shared), pytest.param("llama-bpe", marks=shared), "llama-spm")


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not present (real models: ../shared/tools/fetch-models.sh)")
    return path


@pytest.fixture(scope="module")
def metadata():
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = GGUFFile(_require(vocab_path(name))).metadata
        return cache[name]
    return get


@pytest.fixture(scope="module")
def tok(metadata):
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_metadata(metadata(name))
        return cache[name]
    return get


def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 reading: inputs are separated by the exact string
    "\\n__ggml_vocab_test__\\n" (so an input may itself be "\\n" or ""), one .out line
    of ids per input."""
    raw = _require(vocab_path(name).with_suffix(".gguf.inp")).read_bytes().decode()
    sep = "\n__ggml_vocab_test__\n"
    inputs, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(sep, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(sep)
    lines = vocab_path(name).with_suffix(".gguf.out").read_text().split("\n")
    assert len(lines) >= len(inputs)
    return [(s, [int(x) for x in line.split()]) for s, line in zip(inputs, lines)]


# -- llama.cpp's vectors ------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(tok, name):
    vectors = read_vectors(name)
    assert len(vectors) == 46
    t = tok(name)
    wrong = [(s, t.encode(s), ids) for s, ids in vectors if t.encode(s) != ids]
    assert not wrong, "\n".join(f"{s!r}: got {g} expected {e}" for s, g, e in wrong)


@pytest.mark.parametrize("name", (pytest.param("qwen2", marks=shared), "llama-spm"))
def test_decode_round_trips(tok, name):
    t = tok(name)
    for s, ids in read_vectors(name):
        assert t.decode(ids) == s


@shared
def test_llama_bpe_decode_cleans_spaces_like_llama_cpp(tok):
    # Llama 3 keeps llama.cpp's clean_spaces: " ?" loses its space, so two of the
    # vectors do not round-trip (in llama.cpp neither); every other one does.
    t = tok("llama-bpe")
    for s, ids in read_vectors("llama-bpe"):
        assert t.decode(ids) == s.replace(" ?", "?")
    text = "a ' b don 't I 'm we 're they 'll x , y . z ! w ?"
    assert t.decode(t.encode(text)) == "a'b don 't I'm we're they 'll x, y. z! w?"
    # Qwen2 turns the clean-up off.
    assert tok("qwen2").decode(tok("qwen2").encode(text)) == text


def test_spm_leading_space(tok):
    t = tok("llama-spm")
    assert t.encode("Hello") == [15043]             # "▁Hello": a space is prefixed
    assert t.encode(" Hello") == [29871, 15043]
    assert t.decode([15043]) == "Hello"             # ... and stripped again
    assert t.decode([15043], continuation=True) == " Hello"
    assert t.decode([1, 15043]) == "<s> Hello"      # only from the very first token
    # After a special token the next fragment gets its own prefix space, as in llama.cpp.
    assert t.encode("<s>Hello</s> world", parse_special=True) == [1, 15043, 2, 29871, 3186]


@pytest.mark.parametrize("name", known_pre_tokenizers())
def test_every_pre_tokenizer_splits_without_losing_text(name):
    # Only qwen2, llama-bpe and default have llama.cpp vectors here; the other
    # registered regexes must at least compile and cover the text exactly.
    sample = "Hello, y'all! I'VE 3333 apples  \n\n  naïve Éclair 我想 🦙.cpp\t\tend "
    words = [w for w, _ in hf_pre_tokenizer(pre_tokenizer(name)).pre_tokenize_str(sample)]
    assert bytes(b for w in words for b in map(_gpt2_byte, w)).decode() == sample
    assert len(words) > 10


def _gpt2_byte(c: str) -> int:
    o = ord(c)
    printable = 33 <= o <= 126 or 161 <= o <= 172 or 174 <= o <= 255
    return o if printable else [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172
                                                              or 174 <= b <= 255)][o - 256]


# -- llama.cpp's SPM merge loop, re-implemented as an oracle --------------------

def spm_reference(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """llm_tokenizer_spm_session: repeatedly merge the adjacent pair whose concatenation
    is the best-scoring token (ties: leftmost); leftover characters become byte tokens."""
    sym = list(text)
    nxt = [i + 1 if i + 1 < len(sym) else -1 for i in range(len(sym))]
    prv = [i - 1 for i in range(len(sym))]
    queue: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (tid := ids.get(sym[left] + sym[right])) is not None:
            heapq.heappush(queue, (-scores[tid], left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, len(sym)):
        push(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue  # stale: one side was merged since
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out, i = [], 0 if sym else -1
    while i != -1:
        out += [ids[sym[i]]] if sym[i] in ids else [ids[f"<0x{b:02X}>"] for b in sym[i].encode()]
        i = nxt[i]
    return out


@pytest.mark.parametrize("source", ("llama-spm", "stories"))
def test_spm_matches_llama_cpp_merge_loop(metadata, tok, source):
    if source == "stories":
        md = GGUFFile(_require(STORIES)).metadata
        t = Tokenizer.from_metadata(md)
    else:
        md, t = metadata(source), tok(source)
    ids = {s: i for i, s in enumerate(md["tokenizer.ggml.tokens"])}
    scores = md["tokenizer.ggml.scores"]
    pieces = [s.replace("▁", " ") for s, ty in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"])
              if ty == TokenType.NORMAL]
    alphabet = list("    aabcdeehilmnorst.,'!?\n\t0123") + ["é", "я", "中", "😀", "\u0301"]
    rng = random.Random(0)
    for _ in range(400):
        if rng.random() < 0.5:   # random characters: spaces runs, byte fallback
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        else:                    # vocabulary pieces: many competing merges of equal rank
            s = "".join(rng.choice(pieces) + " " * rng.choice((0, 0, 1, 3)) for _ in range(6))
        assert t.encode(s) == spm_reference("▁" + s.replace(" ", "▁"), ids, scores), repr(s)


# -- special tokens, BOS/EOS, end of generation ----------------------------------

@shared
def test_special_tokens_parse_only_when_asked(tok):
    t = tok("qwen2")
    im_start = t.id_of("<|im_start|>")
    assert im_start == 151644
    assert im_start not in t.encode("a<|im_start|>b")
    assert t.encode("a<|im_start|>b", parse_special=True) == [64, im_start, 65]
    # user-defined tokens are always matched, as in llama.cpp (and HF)
    assert t.token_type(151660) == TokenType.USER_DEFINED
    assert t.encode("a[PAD151660]b") == [64, 151660, 65]
    # control tokens render only with special=True; user-defined always
    assert t.token_to_piece(im_start) == b"<|im_start|>"
    assert t.token_to_piece(im_start, special=False) == b""
    assert t.token_to_piece(151660, special=False) == b"[PAD151660]"
    assert t.decode([64, im_start, 65], special=False) == "ab"


@shared
def test_bos_eos_rules(tok, metadata):
    bpe, spm, qwen = tok("llama-bpe"), tok("llama-spm"), tok("qwen2")
    # Llama 3 has no add_bos_token key: llama.cpp's llama-bpe default adds BOS.
    assert bpe.add_bos and bpe.encode("Hello", add_special=True) == [128000, 9906]
    assert spm.add_bos and spm.encode("Hello", add_special=True) == [1, 15043]
    assert spm.encode("", add_special=True) == [1] and spm.encode("") == []
    assert not qwen.add_bos and qwen.encode("Hello", add_special=True) == [9707]
    md = dict(metadata("llama-spm"), **{"tokenizer.ggml.add_bos_token": False,
                                        "tokenizer.ggml.add_eos_token": True})
    assert Tokenizer.from_metadata(md).encode("Hello", add_special=True) == [15043, 2]


@shared
def test_stop_ids(tok):
    assert tok("llama-bpe").stop_ids == {128001, 128009}      # <|end_of_text|>, <|eot_id|>
    assert tok("llama-bpe").eot_id == 128009
    assert tok("llama-spm").stop_ids == {2}
    qwen = tok("qwen2")
    assert qwen.stop_ids == {151643, 151645} and qwen.eot_ids == qwen.stop_ids
    assert qwen.is_stop(151645) and not qwen.is_stop(151644)


@shared
def test_vocabulary_facts(tok):
    t = tok("qwen2")
    assert t.vocab_size == 151936
    assert t.bos_id == t.eos_id == 151643
    assert t.id_of("Hello") == 9707 and t.id_of("no such token") is None
    assert t.token_to_piece(220) == b" "                 # "Ġ"
    with pytest.raises(IndexError):
        t.token_to_piece(t.vocab_size)


# -- streaming ---------------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_stream_never_splits_a_character(tok, name):
    t = tok(name)
    text = "a 🦙 llama, нещо, 🚀😶‍🌫️ 我想在apple工作 ✅"
    ids = t.encode(text)
    pieces = [t.token_to_piece(i) for i in ids]
    assert any(p.decode("utf-8", "replace") != p.decode("utf-8", "ignore") for p in pieces), \
        "the text should need tokens that carry part of a character"
    stream = t.stream()
    chunks = [stream.feed(i) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + stream.flush() == t.decode(ids, continuation=True)
    assert t.decode(ids, continuation=True).lstrip(" ") == text


def test_stream_flushes_an_incomplete_character(tok):
    t = tok("llama-spm")
    stream = t.stream()
    assert stream.feed(t.id_of("<0xF0>")) == ""    # first byte of a 4-byte character
    assert stream.feed(t.id_of("<0x9F>")) == ""
    assert stream.flush() == "\ufffd"
    assert stream.feed_many([t.id_of("▁Hello")]) == " Hello"
    assert t.stream().feed(2) == "" and t.stream(special=True).feed(2) == "</s>"


# -- malformed metadata ----------------------------------------------------------

@shared
@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
    ({"tokenizer.ggml.model": "t5"}, "unsupported tokenizer.ggml.model='t5'"),
    ({"tokenizer.ggml.pre": "no-such-pre"}, "unknown pre-tokenizer"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "list of strings"),
    ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type must be a list"),
    ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True,
      "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1],
      "tokenizer.ggml.merges": []}, "no BOS token id"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"], "tokenizer.ggml.token_type": [1, 1, 1],
      "tokenizer.ggml.merges": []}, "duplicate token 'a' has ids 0 and 2"),
])
def test_malformed_metadata(metadata, change, message):
    md = {k: v for k, v in metadata("qwen2").items()}
    for key, value in change.items():
        if value is None:
            md.pop(key, None)
        else:
            md[key] = value
    with pytest.raises(GGUFError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Tokenizer.from_metadata(md)


@shared
def test_missing_pre_tokenizer_falls_back_to_default(metadata, caplog):
    md = dict(metadata("qwen2"))
    del md["tokenizer.ggml.pre"]
    t = Tokenizer.from_metadata(md)
    assert "no tokenizer.ggml.pre" in caplog.text
    assert t.encode("Hello world") == [9707, 1879]


def test_spm_scores_must_cover_the_vocabulary(metadata):
    md = dict(metadata("llama-spm"), **{"tokenizer.ggml.scores": [0.0] * 10})
    with pytest.raises(GGUFError, match="scores"):
        Tokenizer.from_metadata(md)


@shared
def test_build_speed():
    # this process's CPU time: the bounds hold on a loaded machine (wall time counted others' work)
    path = _require(vocab_path("qwen2"))
    start = time.process_time()
    t = Tokenizer.from_gguf(path)               # 152k tokens, 151k merges
    assert time.process_time() - start < 2.0
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 500
    start = time.process_time()
    assert t.decode(t.encode(text)) == text
    assert time.process_time() - start < 1.0


# -- real models: llama.cpp's reference runs --------------------------------------

def _reference(name: str) -> list[dict]:
    return json.loads((REFERENCE / f"{name}.json").read_text())["cases"]


def test_qwen_coder_reference():
    t = Tokenizer.from_gguf(_require(QWEN))
    assert t.stop_ids == {151643, 151645, 151662, 151663, 151664}   # + FIM pad/repo/file-sep
    for case in _reference("qwen2.5-coder-0.5b-instruct"):
        assert t.encode(case["prompt"], add_special=True, parse_special=True) == case["prompt_ids"]
        assert t.decode(case["gen_ids"], continuation=True) == case["text"]
        stream = t.stream()
        assert "".join(stream.feed(i) for i in case["gen_ids"]) + stream.flush() == case["text"]


def test_stories_reference():
    t = Tokenizer.from_gguf(_require(STORIES))
    assert t.vocab_size == 512 and t.bos_id == 1 and t.eos_id == 2
    for case in _reference("stories260K"):
        assert t.encode(case["prompt"], add_special=True) == case["prompt_ids"]   # BOS included
        assert t.decode(case["prompt_ids"][1:]) == case["prompt"]
        # generated tokens continue the prompt: "▁was" keeps its space
        assert t.decode(case["gen_ids"], continuation=True) == case["text"]
        assert t.stream().feed_many(case["gen_ids"]) == case["text"]

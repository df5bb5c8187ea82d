"""Script-adaptive draft vocabulary: character and token classes, prompt scripts, the
exact subset on hand-built vocabularies, and the effect on a real tokenizer."""
from __future__ import annotations

import pytest

from alphallama.spec.draft_vocab import DraftVocab, _water_fill, bytes_class, char_class, prompt_scripts
from alphallama.tokenizer import Tokenizer
from conftest import VOCAB, require


@pytest.mark.parametrize("ch, want", [
    ("a", "latin"), ("é", "latin"), ("ж", "cyrillic"), ("λ", "greek"), ("ש", "hebrew"), ("ع", "arabic"),
    ("ह", "devanagari"), ("ก", "thai"), ("한", "hangul"), ("の", "kana"), ("カ", "kana"), ("中", "han"),
    ("。", "cjk_punct"), ("，", "cjk_punct"), ("7", "common"), (" ", "common"), ("—", "common"),
    ("€", "symbol"), ("😀", "symbol"), ("አ", "other"),
])
def test_char_class(ch, want):
    assert char_class(ch) == want


@pytest.mark.parametrize("piece, want", [
    (b" the", "latin"), (" привет".encode(), "cyrillic"), ("中文".encode(), "han"), (b"    ", "common"),
    (b"):\n", "common"), ("ж".encode()[:1], "cyrillic"),     # a lead byte: U+0400..U+043F
    ("中".encode()[:2], "han"), ("ह".encode()[:2], "devanagari"),
    (b"\xe0", "bytes"),                                       # U+0000..U+0FFF: many scripts
    (b"\xa7", "bytes"), (b"\x80abc", "latin"),                # continuation bytes, then letters
    ("a中中".encode(), "han"),                                 # the most frequent script wins
])
def test_bytes_class(piece, want):
    assert bytes_class(piece) == want


def test_prompt_scripts():
    assert prompt_scripts("Привет, мир! Как дела?") == ["cyrillic"]
    assert prompt_scripts("日本語のテキストです") == ["kana", "han"]
    assert prompt_scripts("print('hi') # 中") == ["latin"]            # one Han letter is under min_chars
    assert prompt_scripts("12 + 3 = 15", min_chars=1) == []


def test_water_fill():
    assert _water_fill({"a": 10, "b": 1, "c": 10}, 7) == {"a": 3, "b": 1, "c": 3}
    assert _water_fill({"a": 2, "b": 2}, 10) == {"a": 2, "b": 2}
    assert _water_fill({"a": 5, "b": 5, "c": 5}, 2) == {"a": 1, "b": 1, "c": 0}


# ids:    0        1-3        4-9        10-12        13-20   21          22      23        24
LABELS = (["special"] + ["common"] * 3 + ["latin"] * 6 + ["cyrillic"] * 3 + ["han"] * 8
          + ["cjk_punct", "bytes", "symbol", "unused"])


def test_subset_han_prompt():
    dv = DraftVocab.from_labels(LABELS)
    # special and bytes (0, 22); 10 rows for the base pool (common + latin, 1-9), han and
    # cjk_punct (its companion): 3 each, cjk_punct has 1, then 1 more each to base and
    # han, and the last one to the first pool (base)
    assert dv.subset(["han"], 12).tolist() == [0, 1, 2, 3, 4, 5, 13, 14, 15, 16, 21, 22]
    assert dv.fixed(12).tolist() == list(range(12))


def test_subset_cyrillic_prompt_and_fill():
    dv = DraftVocab.from_labels(LABELS)
    # 12 rows for the base pool (9) and cyrillic (3): both whole
    assert dv.subset(["cyrillic"], 14).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 22]
    # 2 more rows: the rest by id, never an unused token
    assert dv.subset(["cyrillic"], 16).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 22]
    assert 24 not in dv.subset(["cyrillic"], 24).tolist()
    assert dv.subset(["han"], 100).tolist() == list(range(25))           # larger than the vocabulary: all
    assert dv.subset([], 6).tolist() == [0, 1, 2, 3, 4, 22]               # the base pool by id


@pytest.fixture(scope="module")
def qwen_vocab():
    tok = Tokenizer.from_gguf(require(VOCAB / "ggml-vocab-qwen2.gguf"))
    return tok, DraftVocab.from_tokenizer(tok)


@pytest.mark.parametrize("text, scripts", [
    ("Москва — столица России, крупнейший по численности населения город страны.", {"cyrillic"}),
    ("北京是中华人民共和国的首都，也是全国的政治中心。", {"han"}),
    ("서울은 대한민국의 수도이자 최대 도시이다.", {"hangul"}),
])
@pytest.mark.shared
def test_real_vocab_adaptive_subset_covers_the_language(qwen_vocab, text, scripts):
    tok, dv = qwen_vocab
    ids = tok.encode(text)
    classes = {dv.names[dv.classes[i]] for i in ids}
    assert classes <= scripts | {"common", "bytes", "cjk_punct", "latin"}
    assert set(dv.fixed(32768).tolist()) & set(dv.ids_of("latin").tolist()) <= set(dv.subset([], 32768).tolist())
    n = 32768
    adaptive = set(dv.subset_for_text(text, n).tolist())
    fixed = set(dv.fixed(n).tolist())
    missed_fixed = sum(i not in fixed for i in ids)
    assert all(i in adaptive for i in ids)       # every token of the sentence can be drafted
    assert missed_fixed > 0                       # ... which the first 32768 ids cannot
    assert len(adaptive) == n
    special = tok.eos_id
    assert special in adaptive                    # end of text can always be drafted

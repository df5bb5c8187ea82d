"""The embedded model's tokenizer: byte-level BPE trained with `tokenizers` on the corpus,
split by the same pre-tokenizer as Qwen2 (`tokenizer.ggml.pre = "qwen2"`, which
alphallama.tokenizer and llama.cpp both know), with ChatML's special tokens, stored in
the GGUF as `gpt2` tokens + merges.

    hf = train_bpe(texts, vocab_size)     # a tokenizers.Tokenizer
    kv = gguf_tokenizer_kv(hf, chat_template)   # {key: (value, GGUFValueType[, sub type])}
"""
from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..tokenizer import hf_pre_tokenizer, pre_tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PRE = "qwen2"


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """BPE over the texts; the special tokens take the last ids."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = hf_pre_tokenizer(pre_tokenizer(PRE))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(list(SPECIALS))
    return tok


def vocab_list(hf: HFTokenizer) -> list[str]:
    v = hf.get_vocab(with_added_tokens=True)
    tokens = [""] * len(v)
    for t, i in v.items():
        tokens[i] = t
    if "" in tokens:
        raise ValueError("the trained vocabulary has holes in its ids")
    return tokens


def merges_list(hf: HFTokenizer) -> list[str]:
    merges = json.loads(hf.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in merges]


def gguf_tokenizer_kv(hf: HFTokenizer, chat_template: str) -> list[tuple]:
    """(key, value, GGUFValueType, sub type or None) for every tokenizer key, as
    convert_hf_to_gguf writes them for a Qwen2-style vocabulary."""
    from gguf import GGUFValueType as VT
    tokens = vocab_list(hf)
    ids = {t: i for i, t in enumerate(tokens)}
    types = [3 if t in SPECIALS else 1 for t in tokens]        # CONTROL / NORMAL
    return [
        ("tokenizer.ggml.model", "gpt2", VT.STRING, None),
        ("tokenizer.ggml.pre", PRE, VT.STRING, None),
        ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.token_type", types, VT.ARRAY, VT.INT32),
        ("tokenizer.ggml.merges", merges_list(hf), VT.ARRAY, VT.STRING),
        ("tokenizer.ggml.bos_token_id", ids["<|endoftext|>"], VT.UINT32, None),
        ("tokenizer.ggml.eos_token_id", ids["<|im_end|>"], VT.UINT32, None),
        ("tokenizer.ggml.padding_token_id", ids["<|endoftext|>"], VT.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, VT.BOOL, None),
        ("tokenizer.chat_template", chat_template, VT.STRING, None),
    ]


def metadata_dict(kv: list[tuple]) -> dict:
    """The tokenizer keys as our reader returns them (for Tokenizer.from_metadata)."""
    return {k: v for k, v, *_ in kv}

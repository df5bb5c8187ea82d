"""The synthetic model's vocabulary: every `tokenizer.*` key copied from a vocab GGUF
or, with no source, a trivial byte-level BPE vocabulary (so the product can make
models without shared data).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType, TokenType

from .reader import GGUFFile
from .synth_spec import SyntheticSpec


@dataclass(frozen=True)
class _KV:
    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def _tokenizer_kv(key: str, value: Any) -> _KV:
    """The GGUF type of a copied tokenizer value, as llama.cpp's writers store it.

    Our reader returns plain Python values, so the type comes back from the value:
    token ids are uint32, token types int32, scores float32 (llama.cpp checks the
    stored type of every key it reads, so these must be exact)."""
    scalar = {bool: GGUFValueType.BOOL, str: GGUFValueType.STRING,
              float: GGUFValueType.FLOAT32, int: GGUFValueType.UINT32}
    element = scalar | {int: GGUFValueType.INT32}
    if isinstance(value, list):
        return _KV(key, value, GGUFValueType.ARRAY, element[type(value[0])])
    return _KV(key, value, scalar[type(value)])


def _copied_vocab(path: str) -> tuple[list[_KV], int]:
    md = GGUFFile(path).metadata
    tokens = md.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens to copy a vocabulary from")
    kvs = [_tokenizer_kv(k, v) for k, v in md.items()
           if k.startswith("tokenizer.") and not (isinstance(v, list) and not v)]
    return kvs, len(tokens)


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 are mapped in order to code points 256 and up."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_VOCAB_MIN = 258   # 256 bytes, one merge, <|endoftext|>


def byte_vocab(n_vocab: int) -> list[_KV]:
    """A trivial GPT-2-style byte-level BPE vocabulary: the 256 byte tokens, one merge
    (two spaces; llama.cpp needs a non-empty merge list), <|endoftext|> as BOS/EOS/pad,
    then [PAD<i>] UNUSED tokens up to `n_vocab`, as convert_hf_to_gguf pads."""
    if n_vocab < BYTE_VOCAB_MIN:
        raise ValueError(f"a byte-level vocabulary needs at least {BYTE_VOCAB_MIN} tokens, not {n_vocab}")
    space = _byte_to_unicode()[ord(" ")]
    tokens = _byte_to_unicode() + [space * 2, "<|endoftext|>"]
    types = [int(TokenType.NORMAL)] * 257 + [int(TokenType.CONTROL)]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [int(TokenType.UNUSED)] * (n_vocab - len(types))
    eos = 257
    strs, u32 = GGUFValueType.STRING, GGUFValueType.UINT32
    return [
        _KV("tokenizer.ggml.model", "gpt2", strs),
        _KV("tokenizer.ggml.pre", "qwen2", strs),
        _KV("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, strs),
        _KV("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        _KV("tokenizer.ggml.merges", [f"{space} {space}"], GGUFValueType.ARRAY, strs),
        _KV("tokenizer.ggml.bos_token_id", eos, u32),
        _KV("tokenizer.ggml.eos_token_id", eos, u32),
        _KV("tokenizer.ggml.padding_token_id", eos, u32),
        _KV("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL),
    ]


def vocab_of(spec: SyntheticSpec) -> tuple[list[_KV], int]:
    """The tokenizer keys of `spec`'s file and its vocabulary size."""
    if spec.vocab_from is not None:
        return _copied_vocab(spec.vocab_from)
    return byte_vocab(spec.vocab_size), spec.vocab_size

"""Tokenizer built from a GGUF vocabulary that reproduces llama.cpp token for token.

`tokenizer.ggml.model` picks the vocabulary model from a registry:

- "gpt2": byte-level BPE. The text is split into words by the pre-tokenizer's regexes
  (llama.cpp's, keyed by `tokenizer.ggml.pre`), each word's bytes are mapped to GPT-2's
  printable characters and merged by rank.
- "llama": SentencePiece BPE. Spaces become "▁", a space is prefixed, pieces merge by
  score, characters missing from the vocabulary fall back to <0xXX> byte tokens.

The merge loops run in the `tokenizers` library (Rust). Around them this module does
what llama.cpp's llama-vocab.cpp does: it splits the text at special tokens, adds
BOS/EOS, renders pieces, cleans up spaces when detokenizing, and decides which tokens
end generation. The vectors in ../shared/data/vocab (llama.cpp's test-tokenizer-0) are
the proof; tests/test_tokenizer.py checks every one.

The parts: `pretokenize` (the byte-level pre-tokenizers' regexes, keyed by
`tokenizer.ggml.pre`), `vocab` (token types, the vocabulary checks, the
end-of-generation set), `models` (the "gpt2" and "llama" vocabulary models) and
`core` (Tokenizer, Detokenizer). Everything callers use is importable from here.
"""
from __future__ import annotations

from .core import Detokenizer, Tokenizer
from .pretokenize import PreTokenizer, hf_pre_tokenizer, known_pre_tokenizers, pre_tokenizer
from .vocab import TokenType

__all__ = ["Detokenizer", "PreTokenizer", "TokenType", "Tokenizer", "hf_pre_tokenizer", "known_pre_tokenizers",
           "pre_tokenizer"]

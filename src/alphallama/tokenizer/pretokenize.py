"""Pre-tokenizers of byte-level BPE vocabularies: llama.cpp's regexes, keyed by
`tokenizer.ggml.pre`, and the `tokenizers` pipeline that applies them."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import Regex
from tokenizers import pre_tokenizers as hf_pre

from alphallama.gguf.reader import GGUFError

log = logging.getLogger(__name__)

# llama.cpp's regexes are applied in order; each one splits the pieces left by the
# previous one into matches and the gaps between.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# The contractions are spelled out case by case instead of (?i:...): case folding
# would also match e.g. "ſ" (long s), which llama.cpp's pattern does not.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's rewrite of GPT-4o's pattern: "(?=\p{L})[^a-z]" stands for "a letter that
# is not ASCII lower case", which is what llama.cpp matches (not Unicode case classes).
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text, and llama.cpp's per-type defaults."""
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is emitted whole (Llama 3)
    clean_spaces: bool = True    # decode() removes the space in " ," " 's" etc.
    add_bos: bool = False        # used when the file has no tokenizer.ggml.add_bos_token


_DEFAULT_PRE = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {}


def _register(names: str, pre: PreTokenizer) -> None:
    for name in names.split():
        _PRE_TOKENIZERS[name] = pre


_register("default", _DEFAULT_PRE)
_register("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
          PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True))
_register("dbrx smaug-bpe", PreTokenizer((_LLAMA3,)))
_register("qwen2 deepseek-r1-qwen kormo hunyuan", PreTokenizer((_QWEN2,), clean_spaces=False))
_register("stablelm2 megrez", PreTokenizer((_QWEN2,)))
_register("qwen35", PreTokenizer((_QWEN35,), clean_spaces=False))
_register("gpt-2 phi-2 mpt olmo jais exaone4 jina-es jina-de gigachat a.x-4.0 mellum",
          PreTokenizer((_GPT2,)))
_register("trillion granite-docling", PreTokenizer((_GPT2,), clean_spaces=False))
_register("starcoder refact codeshell exaone minerva-7b", PreTokenizer((r"\p{N}", _GPT2)))
_register("command-r smollm", PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False))
_register("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")))
_register("gpt-4o llama4 kanana2", PreTokenizer((_GPT4O,), clean_spaces=False))
_register("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, clean_spaces=False, add_bos=True))


def known_pre_tokenizers() -> list[str]:
    return sorted(_PRE_TOKENIZERS)


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer named by `tokenizer.ggml.pre`. A missing name means llama.cpp's
    'default' (with a warning); an unknown one is refused, as llama.cpp refuses it: a
    guessed split would tokenize silently wrong."""
    if name is None or name == "":
        log.warning("tokenizer metadata has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                    "pre-tokenizer (generation quality may suffer; reconvert the model)")
        return _DEFAULT_PRE
    if name not in _PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer metadata: unknown pre-tokenizer tokenizer.ggml.pre={name!r} "
                        f"(known: {', '.join(known_pre_tokenizers())})")
    return _PRE_TOKENIZERS[name]


def hf_pre_tokenizer(pre: PreTokenizer) -> hf_pre.PreTokenizer:
    """The `tokenizers` pipeline for a byte-level vocabulary: each regex splits the text
    into matches and the gaps between them, then bytes map to GPT-2 characters."""
    return hf_pre.Sequence([hf_pre.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                           + [hf_pre.ByteLevel(add_prefix_space=False, use_regex=False)])

"""llama.cpp's answers for the llama-server routes' tests: what /tokenize (ids and pieces),
/detokenize and /v1/embeddings (mean, last and cls pooling, Euclidean-normalized:
llama-server with --embeddings --pooling mean|last|cls) give on the committed models, as small JSON under
tests/data/reference/llama-routes-<model>.json.

llama-cpp-python is NOT a dependency of alphallama; run it from its own venv (this
script does not import alphallama):

    /work/lcpenv/bin/python bench/llama_server_routes_reference.py MODEL.gguf OUT.json

The calls mirror llama-server's: /tokenize is common_tokenize(vocab, text, add_special,
parse_special) and each piece common_token_to_piece(token, special=true); /detokenize
joins those pieces; /v1/embeddings tokenizes with add_special and parse_special, pools
the final hidden states, and divides by the Euclidean norm.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json

import llama_cpp
import numpy as np

TEXTS = ["Once upon a time", "á", "def add(a, b):\n    return a + b\n", "<|im_start|>user\nhi<|im_end|>",
         "  two  spaces and\ttabs", "naïve café ☕"]
EMBED_TEXTS = ["Once upon a time", "def add(a, b):\n    return a + b\n", "hello world"]
POOLINGS = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
            "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}


def tokenize(model, text: str, add_special: bool, parse_special: bool) -> list[int]:
    raw = text.encode()
    n = len(raw) + 8
    buf = (llama_cpp.llama_token * n)()
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    got = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, n, add_special, parse_special)
    assert got >= 0, got
    return list(buf[:got])


def piece(model, token: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, True)
    assert n >= 0, n
    return buf.raw[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    a = ap.parse_args()
    tok = llama_cpp.Llama(a.model, vocab_only=True, verbose=False)
    cases = []
    for text in TEXTS:
        for add_special in (False, True):
            for parse_special in (False, True):
                ids = tokenize(tok._model, text, add_special, parse_special)
                pieces = [piece(tok._model, t) for t in ids]
                cases.append({"content": text, "add_special": add_special, "parse_special": parse_special,
                              "ids": ids, "pieces": [list(p) for p in pieces],
                              "detokenized": b"".join(pieces).decode("utf-8", errors="replace")})
    embeddings = {}
    for name, pooling in POOLINGS.items():
        emb = llama_cpp.Llama(a.model, embedding=True, pooling_type=pooling, n_ctx=512, n_batch=512, n_ubatch=512,
                              n_threads=1, verbose=False)
        embeddings[name] = []
        for text in EMBED_TEXTS:
            ids = tokenize(emb._model, text, True, True)
            assert ids == emb.tokenize(text.encode()), "embed() tokenizes as llama-server does for these texts"
            v = np.asarray(emb.embed(text, normalize=False), dtype=np.float64)   # pooled [D]
            v = v / np.linalg.norm(v)
            embeddings[name].append({"input": text, "ids": ids, "embedding": [round(float(x), 7) for x in v]})
        del emb
    with open(a.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    out = {"meta": {"model": a.model.rsplit("/", 1)[-1], "sha256": sha, "llama_cpp_python": llama_cpp.__version__,
                    "made": datetime.date.today().isoformat(), "script": "bench/llama_server_routes_reference.py"},
           "tokenize": cases, "embeddings": embeddings}
    with open(a.out, "w") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()

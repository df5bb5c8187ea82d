"""llama.cpp's greedy continuations of the real Gemma 3 270M (Q4_K_M), for the tests.

Run with the llama.cpp venv (llama-cpp-python 0.3.36's CPU build; this script does not
import alphallama):

    /work/lcpenv/bin/python bench/llamacpp_gemma3.py \
        [--model ~/.cache/alphallama/models/gemma-3-270m-q4_k_m.gguf] \
        [--out tests/data/reference/gemma-3-270m-q4_k_m.json]

Raw prompts (BOS added as the file says), tokenized by llama.cpp; 64 greedy tokens, one
llama_decode per token, 2 threads, llama.cpp's defaults otherwise (f16 KV cache, flash
attention auto); top-5 log-probabilities (float64 log-softmax of its float32 logits) at
every generated position, as tests/data/reference/qwen2.5-coder-0.5b-instruct.json has.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]
N_GEN = 64


def main() -> None:
    import llama_cpp
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="~/.cache/alphallama/models/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "reference",
                                                  "gemma-3-270m-q4_k_m.json"))
    args = ap.parse_args()
    path = os.path.expanduser(args.model)
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    cases = []
    for text in PROMPTS:
        llm.reset()
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.eval(ids)
        gen, top5 = [], []
        for _ in range(N_GEN):
            r = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            lp = r - (r.max() + np.log(np.exp(r - r.max()).sum()))
            top = np.argsort(-lp, kind="stable")[:5]
            top5.append([[int(t), round(float(lp[t]), 6)] for t in top])
            gen.append(int(top[0]))
            llm.eval([gen[-1]])
        out = llm.detokenize(gen).decode("utf-8", errors="replace")
        cases.append({"kind": "raw", "input": text, "prompt_ids": ids, "gen_ids": gen, "text": out, "top5": top5})
        print(repr(text), "->", repr(out[:60]))
    with open(path, "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    doc = {"meta": {"model": os.path.basename(path), "sha256": sha,
                    "engine": f"llama.cpp CPU build (llama-cpp-python {llama_cpp.__version__}), 2 threads, "
                              "defaults (f16 KV cache, flash attention auto), one llama_decode per token",
                    "sampling": "greedy (argmax)",
                    "note": "prompt_ids include BOS; top5 = llama.cpp's top-5 (id, logprob) at each generated position"},
           "cases": cases}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()

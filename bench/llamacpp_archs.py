"""llama.cpp's logits for the tiny synthetic architecture presets, as small JSON for the tests.

For each preset: write the synthetic GGUF (alphallama's writer, seed 0, all F32), then in a
child process of the llama.cpp venv (llama-cpp-python 0.3.36's CPU build; it is not a
dependency of alphallama, and the child does not import alphallama) run a fixed 8-token
prompt and 64 greedy tokens, one llama_decode per token, with an F32 KV cache and flash
attention off (no fp16 anywhere on llama.cpp's side). Stored per position of the 72
(prompt + greedy): the top 8 (id, logit), 8 fixed ids' logits (rounded to 1e-6), the row's max |logit|
and logsumexp; and the greedy ids and the file's sha256 (the test rewrites the file and
checks it is the same bytes).

    python bench/llamacpp_archs.py [--lcp /work/lcpenv/bin/python] [--only tiny-gemma3,...]
        [--out tests/data/reference/archs]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

PRESETS = ("tiny-llama31", "tiny-llama-yarn", "tiny-llama-linear", "tiny-gemma3", "tiny-gpt-oss", "tiny-phi3",
           "tiny-mistral3", "tiny-qwen2moe")
PROMPT = [5, 300, 17, 17, 42, 511, 256, 9]
N_GEN = 64
N_CTX = 256
TOP = 8
FIXED = list(range(3, 512, 64))   # 8 ids spread over the 512-token vocabulary


def worker(path: str) -> dict:
    import numpy as np
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, verbose=False,
                          n_threads=2, flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(PROMPT)
    gen = []
    for _ in range(N_GEN):
        gen.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([gen[-1]])                     # one decode per token, as llama-server does
    rows = np.array(llm.scores[:llm.n_tokens], dtype=np.float64)   # [72, vocab]
    out = []
    for r in rows:
        top = np.argsort(-r, kind="stable")[:TOP]
        m = r.max()
        out.append({"top": [[int(i), round(float(r[i]), 6)] for i in top], "fixed": [round(float(r[i]), 6) for i in FIXED],
                    "absmax": round(float(np.abs(r).max()), 6),
                    "logsumexp": round(float(m + np.log(np.exp(r - m).sum())), 6)})
    return {"gen_ids": gen, "rows": out, "llama_cpp_python": llama_cpp.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lcp", default="/work/lcpenv/bin/python", help="python of the llama.cpp venv")
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "reference",
                                                  "archs"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker)), flush=True)
        return

    from alphallama.gguf.writer import PRESETS as ALL, write_synthetic
    os.makedirs(args.out, exist_ok=True)
    for name in (args.only.split(",") if args.only else PRESETS):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name + ".gguf")
            write_synthetic(ALL[name](), path)
            sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
            p = subprocess.run([args.lcp, os.path.abspath(__file__), "--worker", path],
                               capture_output=True, text=True, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if p.returncode or line is None:
            print(f"{name}: llama.cpp failed (rc {p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            continue
        res = json.loads(line[len("RESULT "):])
        doc = {"preset": name, "seed": 0, "quant": "F32", "sha256": sha, "prompt_ids": PROMPT, "n_ctx": N_CTX,
               "fixed_ids": FIXED,
               "engine": f"llama.cpp CPU build (llama-cpp-python {res['llama_cpp_python']}), 2 threads, "
                         "F32 KV cache, flash attention off, one llama_decode per generated token",
               "gen_ids": res["gen_ids"], "rows": res["rows"]}
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        print(f"{name}: {len(res['rows'])} rows, greedy {res['gen_ids'][:8]}...")


if __name__ == "__main__":
    main()

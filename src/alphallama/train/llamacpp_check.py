"""Does llama.cpp load the exported model as it is, tokenize like us and compute the same
logits? Runs llama.cpp (llama-cpp-python, in whatever interpreter has it) on a few
texts and compares with our tokenizer and reference model.

    python -m alphallama.train.llamacpp_check MODEL --llama-python PY -o OUT.json

The llama.cpp side runs this file as a script under PY (it needs only numpy and
llama_cpp there), with every weight in the plain CPU buffer (no repacking: the AMX path
crashes on this machine's llama.cpp build, see bench/llamacpp_crosscheck.py), one thread.
"""
from __future__ import annotations

import json
import subprocess
import sys

TEXTS = [
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """Run the command line."""\n    parser = argparse.ArgumentParser()\n',
    "<|im_start|>user\nRemove every comment from this file.\n\n```python\nx = 1  # one\n```<|im_end|>\n"
    "<|im_start|>assistant\n",
    "class Cache:\n    def __init__(self, size: int = 128) -> None:\n        self._data: dict[str, bytes] = {}\n",
]


def _llama_worker(path: str, texts: list[str]) -> list[dict]:
    import llama_cpp as L
    import numpy as np
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(path.encode(), mp)
    assert model, "llama.cpp could not load the model"
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    out = []
    for text in texts:
        buf = (L.llama_token * 4096)()
        n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, False, True)
        ids = list(buf[:n])
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
        cp.n_threads = cp.n_threads_batch = 1
        ctx = L.llama_init_from_model(model, cp)
        batch = L.llama_batch_init(len(ids), 0, 1)
        for j, t in enumerate(ids):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, j, 1
            batch.seq_id[j][0], batch.logits[j] = 0, 1
        batch.n_tokens = len(ids)
        assert L.llama_decode(ctx, batch) == 0
        logits = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).tolist()
                  for i in range(len(ids))]
        out.append({"ids": ids, "logits": logits})
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    return out


def main(argv=None) -> int:
    import argparse
    from datetime import datetime, timezone

    import torch

    from ..gguf.reader import GGUFFile
    from ..model.loader import load_model
    from ..tokenizer import Tokenizer
    p = argparse.ArgumentParser(prog="python -m alphallama.train.llamacpp_check")
    p.add_argument("model")
    p.add_argument("--llama-python", required=True, help="an interpreter with llama_cpp installed")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    run = subprocess.run([args.llama_python, __file__, "--worker", args.model], input=json.dumps(TEXTS),
                         capture_output=True, text=True, check=True)
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    f = GGUFFile(args.model)
    tok = Tokenizer.from_metadata(f.metadata)
    ref = load_model(f, 512)
    rows = []
    for text, th in zip(TEXTS, theirs):
        ids = tok.encode(text, parse_special=True)
        logits, _ = ref.forward(torch.tensor(ids), 0, ref.new_cache(512))       # [T, V]
        lc = torch.tensor(th["logits"])
        n = min(len(ids), len(th["ids"]))
        diff = (logits[:n] - lc[:n]).abs()
        rows.append({"text": text, "tokens": len(ids), "ids_equal": ids == th["ids"],
                     "max_abs_logit_diff": diff.max().item(), "mean_abs_logit_diff": diff.mean().item(),
                     "logit_scale": logits.abs().max().item(),
                     "argmax_agree": (logits[:n].argmax(-1) == lc[:n].argmax(-1)).float().mean().item()})
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
           "llama_cpp": subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                       capture_output=True, text=True).stdout.strip(),
           "setting": "plain CPU buffers (no repack/AMX), 1 thread, one batch per text, f16 KV cache",
           "note": "llama.cpp quantizes activations to 8 bits for Q8_0 products; our reference is exact f32",
           "texts": rows}
    with open(args.output, "w") as fh:
        json.dump(out, fh, indent=1)
    for r in rows:
        print(f"{r['tokens']:3d} tokens  ids equal {r['ids_equal']}  max |dlogit| {r['max_abs_logit_diff']:.3f} "
              f"(scale {r['logit_scale']:.1f})  argmax agree {r['argmax_agree']:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(_llama_worker(sys.argv[2], json.loads(sys.stdin.read()))))
    else:
        raise SystemExit(main())

"""llama.cpp's logits on the tiny synthetic hybrids (qwen3next, qwen35, qwen35moe), against ours.

For each tiny preset (written here with a fixed seed, all F32), llama.cpp's CPU build
(llama-cpp-python 0.3.36 in its own venv; not a dependency of alphallama) decodes a fixed
prompt in one batch (its chunked delta-net path), then 64 greedy tokens one llama_decode
each (the autoregressive path), with an F32 K/V cache and flash attention off. Every row
of logits is compared here with our reference model (model/qwen35.py: prompt in one
forward, then one row at a time), as max |ours - llama.cpp| / max |llama.cpp| per row;
the greedy tokens must be identical.

tests/data/reference/hybrid-tiny.json keeps what a test needs without llama.cpp: per
preset the file's sha256, the prompt, llama.cpp's greedy ids, and per row its top-5
(id, logit) and 4 seeded random projections of the logits row (unit Gaussian
directions), plus the errors measured here (values to 7 significant digits).

    PYTHONPATH=src python bench/hybrid_llamacpp_reference.py [--llama-python /work/lcpenv/bin/python]
        [-o tests/data/reference/hybrid-tiny.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PRESETS = ("tiny-qwen3next", "tiny-qwen35", "tiny-qwen35moe")
SEED = 7
N_PROMPT, N_GEN, TOP, N_PROJ = 24, 64, 5, 4


def prompt_ids(vocab: int) -> list[int]:
    return np.random.default_rng(SEED).integers(3, vocab, N_PROMPT).tolist()


def projections(vocab: int) -> np.ndarray:
    """[N_PROJ, vocab] unit directions, the same in the writer and the test."""
    p = np.random.default_rng(1234).standard_normal((N_PROJ, vocab))
    return p / np.linalg.norm(p, axis=1, keepdims=True)


# --- the llama.cpp side (run under --llama-python; needs numpy and llama_cpp only) ------------

def _llama_worker(path: str, prompt: list[int], out: str) -> None:
    import llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(path.encode(), mp)
    assert model, "llama.cpp could not load the model"
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 256, 256
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.flash_attn_type = 0
    ctx = L.llama_init_from_model(model, cp)
    batch = L.llama_batch_init(len(prompt), 0, 1)

    def decode(ids, pos0):
        for j, t in enumerate(ids):
            batch.token[j], batch.pos[j], batch.n_seq_id[j] = t, pos0 + j, 1
            batch.seq_id[j][0], batch.logits[j] = 0, 1
        batch.n_tokens = len(ids)
        assert L.llama_decode(ctx, batch) == 0
        return [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in range(len(ids))]

    rows = decode(prompt, 0)
    gen = [int(np.argmax(rows[-1]))]
    for k in range(N_GEN - 1):
        rows += decode([gen[-1]], len(prompt) + k)
        gen.append(int(np.argmax(rows[-1])))
    np.savez(out, logits=np.stack(rows), gen=np.array(gen))


# --- our side ---------------------------------------------------------------------------------

def ours(path: str, prompt: list[int], gen: list[int]) -> np.ndarray:
    """Our logits along llama.cpp's tokens: prompt in one forward, then one row at a time."""
    import torch

    from alphallama.gguf.reader import GGUFFile
    from alphallama.model.loader import load_model
    torch.set_num_threads(1)
    m = load_model(GGUFFile(path), 256)
    cache = m.new_cache()
    rows = [m.forward(torch.tensor(prompt), 0, cache)[0]]
    for k, t in enumerate(gen[:-1]):
        rows.append(m.forward(torch.tensor([t]), len(prompt) + k, cache)[0])
    return torch.cat(rows).numpy()


def _g7(x: float) -> float:
    return float(f"{x:.7g}")


def summary(logits: np.ndarray, proj: np.ndarray) -> dict:
    top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP]
    return {"top": [[[int(i), _g7(r[i])] for i in t] for r, t in zip(logits, top)],
            "proj": [[_g7(v) for v in row] for row in logits.astype(np.float64) @ proj.T],
            "max_abs": [_g7(v) for v in np.abs(logits).max(1)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", default="/work/lcpenv/bin/python")
    ap.add_argument("-o", "--out", default="tests/data/reference/hybrid-tiny.json")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _llama_worker(a.worker[0], json.loads(a.worker[1]), a.worker[2])
        return 0
    from alphallama.gguf.writer import PRESETS as P
    from alphallama.gguf.writer import write_synthetic
    result = {"source": "llama-cpp-python 0.3.36 (vendored llama.cpp), CPU, 1 thread, F32 KV, flash attention off",
              "seed": SEED, "n_prompt": N_PROMPT, "n_gen": N_GEN, "models": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in PRESETS:
            path = str(Path(d) / f"{name}.gguf")
            spec = P[name](seed=SEED)
            write_synthetic(spec, path)
            prompt = prompt_ids(spec.vocab_size)
            out = str(Path(d) / f"{name}.npz")
            subprocess.run([a.llama_python, __file__, "--worker", path, json.dumps(prompt), out], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ref = np.load(out)
            lc, gen = ref["logits"], ref["gen"].tolist()
            mine = ours(path, prompt, gen)
            rel = np.abs(mine - lc).max(1) / np.abs(lc).max(1)
            our_gen = mine[N_PROMPT - 1:].argmax(1).tolist()
            print(f"{name}: max rel {rel.max():.2e} (prompt rows {rel[:N_PROMPT].max():.2e}, generated "
                  f"{rel[N_PROMPT:].max():.2e}), greedy identical: {our_gen == gen}")
            result["models"][name] = {
                "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "prompt_ids": prompt,
                "gen_ids": gen, "measured_max_rel": float(rel.max()), "our_greedy_identical": our_gen == gen,
                **summary(lc, projections(lc.shape[1]))}
    Path(a.out).write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

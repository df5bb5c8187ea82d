"""GPU check of the expert store's prefill and CPU tier on a small synthetic qwen3moe:
a prompt of more than 64 rows through the GEMM prefill with a store (bank slots + host
tier read over PCIe) must give the resident engine's prefill logits bit for bit; then
greedy decode with the CPU workers at several shares must give the same tokens as with
every expert in the bank (the expert contract). Prints one line per check; JSON to $OUT.

    python bench/gpu_store_prefill_check.py [--commit SHA]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import SyntheticSpec, uniform_mix, write_synthetic
from alphallama.runtime.gpu_model import GPUModel

SPEC = SyntheticSpec(arch="qwen3moe", name="store-check", n_layers=4, d_model=512, n_heads=8, n_kv_heads=2,
                     head_dim=64, d_ff=1024, n_experts=16, n_experts_used=4, d_ff_expert=256, vocab_size=4096,
                     ctx_len=1024, quant=uniform_mix(T.Q4_K) | {"blk.1.ffn_down_exps": T.Q6_K}, seed=3)


def greedy(m: GPUModel, prompt: torch.Tensor, n: int) -> list[int]:
    cache = m.new_cache(512)
    logits, _ = m.forward(prompt, 0, cache)
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits, _ = m.forward(torch.tensor([out[-1]]), prompt.shape[0] + i, cache)
        out.append(int(logits[-1].argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    args = ap.parse_args()
    path = "/tmp/store-check.gguf"
    write_synthetic(SPEC, path)
    f = GGUFFile(path)
    prompt = torch.tensor([(13 * i + 5) % 4000 for i in range(200)])
    res: dict = {"commit": args.commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": {}}
    ref = GPUModel(f, 512, "cuda")
    want = ref.forward(prompt, 0, ref.new_cache(512))[0].clone()
    del ref
    m = GPUModel(f, 512, "cuda", expert_slots=20, cpu_tier=True)
    table = m.store.table.clone()
    got = m.forward(prompt, 0, m.new_cache(512))[0]
    res["checks"]["store prefill == resident prefill (bits)"] = bool(torch.equal(got, want))
    res["checks"]["bank untouched by prefill"] = bool(torch.equal(m.store.table, table))
    toks = {}
    for share in (1.0, 0.0, 0.6):
        m.cpu_link.set_share(share)
        m.store.reset()
        toks[share] = greedy(m, prompt[:40], 48)
    m.cpu_link.check()
    res["workers"] = {"threads": m.cpu_experts.threads, "posts": int(m.cpu_link.seq.item())}
    del m
    full = GPUModel(f, 512, "cuda", expert_slots=64, cpu_tier=True)   # every expert in the bank
    toks["bank"] = greedy(full, prompt[:40], 48)
    res["checks"]["decode tokens equal across CPU shares and all-bank"] = len({tuple(t) for t in toks.values()}) == 1
    res["tokens"] = {str(k): v for k, v in toks.items()}
    Path(os.environ.get("OUT", "."), f"gpu_store_check-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(res, indent=1))
    for k, v in res["checks"].items():
        print(f"{k}: {v}")
    print("workers:", res["workers"])


if __name__ == "__main__":
    main()

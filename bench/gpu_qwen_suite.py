"""Qwen2.5-Coder-0.5B-Instruct on the GPU over the public arena suite: plain greedy and
n-gram speculation (exact mode), token ids kept so the copy-drafter replay statistics
can be computed from them anywhere. Writes $OUT/gpu_qwen_suite-*.json.

    PYTHONUNBUFFERED=1 python bench/gpu_qwen_suite.py MODEL.gguf
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.bench.suite import load_suite
from alphallama.engine import Engine, Generation  # noqa: E402
from alphallama.spec.config import SpecConfig


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def main() -> int:
    path = sys.argv[1]
    scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0      # token budgets (quick checks)
    device = os.environ.get("ALPHA_DEVICE", "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out_dir = Path(os.environ.get("OUT", "."))
    t0 = time.perf_counter()
    eng = Engine.load(path, ctx_size=8192, device=device)
    load_s = time.perf_counter() - t0
    arms = {"plain": SpecConfig("none"), "ngram": SpecConfig("ngram", draft_max=16, ngram_min=2)}
    rows = []
    for item in load_suite().prompts:
        ids = eng.encode_chat(list(item.messages))
        if len(ids) >= eng.ctx_size:
            print(f"{item.id}: prompt of {len(ids)} tokens does not fit {eng.ctx_size}; skipped", flush=True)
            continue
        budget = max(1, int(item.max_tokens * scale))
        rec = {"id": item.id, "set": item.set, "prompt_ids": ids, "max_tokens": budget}
        for name, spec in arms.items():
            eng.cached = []                       # fresh prefill for each arm: same state
            eng.cache.length = 0
            gen = Generation()
            toks = list(eng.generate(ids, budget, gen=gen, spec=spec))
            sync()
            rec[name] = {"gen_ids": toks, "finish_reason": gen.finish_reason, "timings": gen.stats.timings(),
                         "spec": gen.spec.to_dict()}
        rec["equal"] = rec["plain"]["gen_ids"] == rec["ngram"]["gen_ids"]
        p, n = rec["plain"]["timings"], rec["ngram"]["timings"]
        print(f"{item.id} {len(rec['plain']['gen_ids']):4d} tok  plain {p['predicted_per_second']:7.1f} tok/s  "
              f"ngram {n['predicted_per_second']:7.1f} tok/s  {rec['ngram']['spec']['tokens_per_round']:.2f} tok/round  "
              f"equal={rec['equal']}", flush=True)
        rows.append(rec)
    summary = {}
    for s in ("A", "V", "R", "all"):
        sel = [r for r in rows if s == "all" or r["set"] == s]
        summary[s] = {arm: {"tok_s_geomean": geomean([r[arm]["timings"]["predicted_per_second"] for r in sel]),
                            "ms_per_round_geomean": geomean([r[arm]["timings"]["predicted_ms"] / max(1, r[arm]["timings"]["rounds"]) for r in sel]),
                            "tokens_per_round": sum(r[arm]["spec"]["tokens"] for r in sel) / max(1, sum(r[arm]["spec"]["rounds"] for r in sel))}
                      for arm in arms}
    res = {"host": host_state(sys.argv), "model": path, "load_s": load_s, "graph_capture_s": getattr(eng.model, "capture_s", None),
           "weight_bytes": getattr(eng.model, "weight_bytes", None), "budget_scale": scale, "all_equal": all(r["equal"] for r in rows),
           "summary": summary, "prompts": rows}
    print(json.dumps(summary, indent=1))
    (out_dir / f"gpu_qwen_suite-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

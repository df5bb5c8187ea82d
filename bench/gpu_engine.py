"""One device call: synthetic Qwen3-8B-shaped Q4_K_M model -> bench-engine figures,
plus exact-mode speculative == plain greedy on the GPU. Writes $OUT/gpu_engine-*.json.

    PYTHONUNBUFFERED=1 python bench/gpu_engine.py [--layers N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.engine_bench import bench
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.writer import PRESETS, write_synthetic


def spec_exactness(path: str, n_prompts: int = 6, n_tokens: int = 200) -> dict:
    """Plain greedy vs n-gram speculation (exact mode) through the GPU engine."""
    from alphallama.engine import Engine, Generation
    from alphallama.spec.config import SpecConfig
    eng = Engine.load(path, ctx_size=2048, device="cuda")
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n_prompts):
        base = torch.randint(eng.cfg.vocab_size, (24,), generator=g).tolist()
        ids = base * 3                                   # repeats: the copy drafter has work
        g0, g1 = Generation(), Generation()
        plain = list(eng.generate(ids, n_tokens, gen=g0))
        spec = list(eng.generate(ids, n_tokens, gen=g1, spec=SpecConfig("ngram", 16, 2)))
        out.append({"equal": plain == spec, "tokens": len(plain), "plain_ms": g0.stats.predicted_ms,
                    "spec_ms": g1.stats.predicted_ms, "spec_tokens_per_round": g1.spec.tokens_per_round,
                    "plain_tok_s": g0.stats.predicted_per_second, "spec_tok_s": g1.stats.predicted_per_second})
    return {"prompts": out, "all_equal": all(o["equal"] for o in out)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--small", default="tiny-qwen3", help="preset of the small model for the spec==plain check")
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4096])
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    path = "/tmp/synth.gguf"
    t0 = time.perf_counter()
    overrides = {"n_layers": args.layers} if args.layers else {}
    write_synthetic(PRESETS[args.preset](**overrides), path)
    write_s = time.perf_counter() - t0
    print(f"wrote {path} in {write_s:.1f} s", flush=True)
    res = {"host": host_state(sys.argv), "preset": args.preset, "overrides": overrides, "write_s": write_s}
    res["engine"] = bench(path, 8192, 512, 50, args.prefill, [1, 2, 3, 5, 8, 13, 16, 33, 64])
    e = res["engine"]
    print(json.dumps({k: e[k] for k in ("ms_per_round", "tok_s_plain", "floor_tok_s", "share_of_floor_plain",
                                        "w8_over_w1", "graph_speedup", "prefill", "rotation_bitwise_equal",
                                        "graph_capture_s", "load_s")}, default=str), flush=True)
    small = "/tmp/small.gguf"
    write_synthetic(PRESETS[args.small](n_layers=4, d_model=1024, n_heads=8, n_kv_heads=4, head_dim=128,
                                        d_ff=2048, vocab_size=4096, quant="Q4_K_M"), small)
    res["spec_exactness"] = spec_exactness(small)
    print(json.dumps(res["spec_exactness"]), flush=True)
    name = f"gpu_engine-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (out_dir / name).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

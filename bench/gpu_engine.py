"""One device call: synthetic Qwen3-8B-shaped Q4_K_M model -> bench-engine figures,
plus exact-mode speculative == plain greedy on the GPU. Writes $OUT/gpu_engine-*.json.

    PYTHONUNBUFFERED=1 python bench/gpu_engine.py [--layers N] [--no-decode] [--commit SHA]

Prefill is timed here for both prefill paths in the same run (GPUModel.prefill_path
"dequant": Triton dequantize + cuBLAS, and "gemv": 64-row rounds through the decode
graphs, the control arm), as the engine calls it (logits=False, chunks of
prefill_chunk), plus a greedy continuation of one prompt under each path. With
--layers N the figures are for N layers (the head and embeddings are full size).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.engine_bench import bench, time_cuda
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


def prefill_arms(path: str, sizes: list[int], n_gen: int = 16) -> dict:
    """Prefill ms for each path and size; each path's greedy tokens after one prompt."""
    from alphallama.gguf.reader import GGUFFile
    from alphallama.kernels.qgemm import dequantize_into
    from alphallama.runtime.gpu_model import GPUModel
    ctx = max(sizes + [600]) + n_gen + 64
    t0 = time.perf_counter()
    model = GPUModel(GGUFFile(path), ctx, "cuda")
    cache = model.new_cache(ctx)                         # captures the decode graphs
    out: dict = {"load_and_capture_s": time.perf_counter() - t0, "chunk": model.prefill_chunk,
                 "scratch_mib": model.scratch.elements * torch.empty(0, dtype=model.scratch.dtype).element_size() >> 20}
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(model.cfg.vocab_size, (max(sizes),), generator=g)
    for arm in ("dequant", "gemv"):
        model.prefill_path = arm
        for n in sizes:
            def run():
                cache.length = 0
                model.forward(ids[:n], 0, cache, logits=False)
            slow = arm == "gemv" and n > 1024           # ~5 s a call: one warm-up, one timed
            try:                                         # one device call: a failure must not lose the rest
                t1 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t1       # includes Triton compiles on first use
                ms = time_cuda(run, 1, warm=0) if slow else time_cuda(run, 3)
            except Exception as e:  # noqa: BLE001
                out[f"{arm}_{n}"] = {"error": repr(e), "tok_s": float("nan")}
                print(f"prefill {arm} {n}: FAILED {e!r}", flush=True)
                continue
            out[f"{arm}_{n}"] = {"ms": ms, "tok_s": n / ms * 1000, "first_call_s": first_s}
            print(f"prefill {arm:8s} {n:5d}: {ms:9.1f} ms  {n / ms * 1000:8.0f} tok/s", flush=True)
    out["mm_out_dtype_fp32"] = model.scratch.mm_out_dtype
    # where the dequant path's time goes: every weight dequantized once (the GEMMs are the rest)
    ws = [w for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down) if lin is not None
          for w in lin.weights]
    buf = model.scratch

    def deq():
        for w in ws:
            step = max(1, min(w.N, buf.elements // w.K))
            for r0 in range(0, w.N, step):
                r1 = min(w.N, r0 + step)
                dequantize_into(w, buf.rows(r1 - r0, w.K), r0, r1)
    try:
        out["dequant_layers_ms"] = time_cuda(deq, 3)
    except Exception as e:  # noqa: BLE001
        out["dequant_layers_ms"], out["dequant_error"] = float("nan"), repr(e)
    out["dequant_layer_bytes"] = sum(w.nbytes for w in ws)
    # greedy continuation of one prompt (prompt rows but the last by the path, the last
    # row and every generated token by W = 1 rounds, as engine.prefill does)
    prompt = torch.randint(model.cfg.vocab_size, (600,), generator=g)
    try:
        out["generation"] = _generation(model, cache, prompt, n_gen)
    except Exception as e:  # noqa: BLE001
        out["generation"] = {"error": repr(e), "equal": None, "first_equal": None}
    model.prefill_path = "dequant"
    del model, cache
    torch.cuda.empty_cache()
    return out


def _generation(model, cache, prompt: torch.Tensor, n_gen: int) -> dict:
    gen = {}
    for arm in ("dequant", "gemv"):
        model.prefill_path = arm
        cache.length = 0
        model.forward(prompt[:-1], 0, cache, logits=False)
        logits, _ = model.forward(prompt[-1:], len(prompt) - 1, cache)
        last = logits[-1].float().clone()
        toks = []
        for i in range(n_gen):
            toks.append(int(logits[-1].argmax()))
            logits, _ = model.forward(torch.tensor(toks[-1:]), len(prompt) + i, cache)
        gen[arm] = {"tokens": toks, "last_prompt_logits": last}
    d = (gen["dequant"]["last_prompt_logits"] - gen["gemv"]["last_prompt_logits"]).abs()
    return {
        "dequant": gen["dequant"]["tokens"], "gemv": gen["gemv"]["tokens"],
        "equal": gen["dequant"]["tokens"] == gen["gemv"]["tokens"],
        "first_equal": gen["dequant"]["tokens"][0] == gen["gemv"]["tokens"][0],
        "last_prompt_logits_max_abs_diff": d.max().item(),
        "last_prompt_logits_max_abs": gen["gemv"]["last_prompt_logits"].abs().max().item()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--small", default="tiny-qwen3", help="preset of the small model for the spec==plain check")
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--no-decode", action="store_true", help="skip the decode figures (bench-engine)")
    ap.add_argument("--commit", default=None, help="the commit measured (the device copy is no git checkout)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    path = "/tmp/synth.gguf"
    t0 = time.perf_counter()
    overrides = {"n_layers": args.layers} if args.layers else {}
    write_synthetic(PRESETS[args.preset](**overrides), path)
    write_s = time.perf_counter() - t0
    print(f"wrote {path} in {write_s:.1f} s", flush=True)
    res = {"host": host_state(sys.argv), "commit": args.commit, "preset": args.preset, "overrides": overrides,
           "write_s": write_s}
    name = f"gpu_engine-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save = lambda: (out_dir / name).write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    res["prefill"] = prefill_arms(path, args.prefill)
    save()                                               # partial results survive a later failure
    if not args.no_decode:
        res["engine"] = bench(path, 8192, 512, 50, [], [1, 2, 3, 5, 8, 13, 16, 33, 64])
        e = res["engine"]
        print(json.dumps({k: e[k] for k in ("ms_per_round", "tok_s_plain", "floor_tok_s", "share_of_floor_plain",
                                            "w8_over_w1", "graph_speedup", "rotation_bitwise_equal",
                                            "graph_capture_s", "load_s")}, default=str), flush=True)
        save()
    small = "/tmp/small.gguf"
    write_synthetic(PRESETS[args.small](n_layers=4, d_model=1024, n_heads=8, n_kv_heads=4, head_dim=128,
                                        d_ff=2048, vocab_size=4096, quant="Q4_K_M"), small)
    try:
        res["spec_exactness"] = spec_exactness(small)
    except Exception as e:  # noqa: BLE001
        res["spec_exactness"] = {"error": repr(e), "all_equal": None}
    print(json.dumps(res["spec_exactness"]), flush=True)
    save()
    p = res["prefill"]
    print("\npath      " + "".join(f"{n:>12d}" for n in args.prefill) + "   (tok/s)")
    for arm in ("dequant", "gemv"):
        print(f"{arm:8s}  " + "".join(f"{p[f'{arm}_{n}']['tok_s']:12.0f}" for n in args.prefill))
    print(f"dequantize all layer weights once: {p['dequant_layers_ms']:.2f} ms; "
          f"greedy tokens equal: {p['generation']['equal']} (first: {p['generation']['first_equal']}); "
          f"spec == plain: {res['spec_exactness']['all_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One device call: synthetic Qwen3-8B-shaped Q4_K_M model -> bench-engine figures,
plus exact-mode speculative == plain greedy on the GPU. Writes $OUT/gpu_engine-*.json.

    PYTHONUNBUFFERED=1 python bench/gpu_engine.py [--layers N] [--no-decode] [--commit SHA]

Prefill is timed here for several arms in the same run (ARMS: "serial" is the control,
the path before the overlap: one scratch buffer, dequantize then GEMM on one stream,
the old dequantize tile; "overlap" dequantizes each next weight on a side stream;
"graphs" replays each chunk as CUDA graphs between attentions; the others isolate the
tile and the chunk size; --gemv adds the decode-graph path), as
the engine calls it (logits=False, chunks of prefill_chunk). Also: the dequantize pass
alone per tile (GPU time by graph replay, and eager), the GEMMs alone, a profile of
one 512-row chunk (graphs and serial), whether the arms' hidden states are bitwise equal, and a greedy
continuation of one prompt under the dequant and the decode-graph paths. With
--layers N the figures are for N layers (the head and embeddings are full size).
"""
from __future__ import annotations

import argparse
import ast
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


# the dequantize kernel's (rows, slots, warps, whole-slot stores, GPU bf16 convert), formats/dequant.DEQ_TILE;
# OLD_TILE: the serial path's before the overlap
OLD_TILE = (4, 64, 4, False, False)
TILES = [OLD_TILE, (2, 128, 4, False, False), (2, 128, 4, False, True), (2, 128, 4, True, False),
         (2, 128, 4, True, True), (1, 128, 4, True, True), (4, 64, 4, True, True), (4, 128, 8, True, True)]
# (name, overlap, tile (None: the sweep's best), chunk, sizes (None: all), CUDA graphs); "serial" is
# the control arm (the path before the overlap: one buffer, one stream, the old tile)
# the graph arms last: a failed capture must not take the others with it
ARMS = [("serial", False, OLD_TILE, 512, None, False), ("serial_tile", False, None, 512, None, False),
        ("overlap", True, None, 512, None, False), ("overlap_c1024", True, None, 1024, [4096], False),
        ("graphs", False, None, 512, None, True), ("graphs_overlap", True, None, 512, None, True),
        ("graphs_c1024", False, None, 1024, [4096], True)]


def _graph_ms(fn, reps: int = 5) -> float:
    """GPU time of fn's launches replayed as one CUDA graph: no host launch cost in it."""
    fn()                                                 # compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_cuda(g.replay, reps)


def dequant_sweep(model) -> dict:
    """Every layer weight dequantized once (units as the overlap path cuts them), per
    tile: GPU time (graph replay) and with the host's launches (eager)."""
    from alphallama.kernels.prefill.qgemm import units_of
    lins = [lin.weights for L in model.layers for lin in (L.qkv, L.o, L.gate_up, L.down) if lin is not None]
    rows = model.scratch.buffer_elements
    units = [u for ws in lins for u in units_of(ws, rows // ws[0].K)]
    buf = torch.empty(max(u.n * u.K for u in units), dtype=model.scratch.dtype, device=model.device)
    written = sum(u.n * u.K for u in units) * buf.element_size()
    read = sum(w.nbytes * (r1 - r0) // w.N for u in units for w, r0, r1, _ in u.pieces)
    out: dict = {"units": len(units), "bytes_written": written, "bytes_read": read, "tiles": {}}
    for tile in TILES:
        run = lambda: [u.dequantize(buf, tile) for u in units]  # noqa: E731
        try:
            g = _graph_ms(run)
            e = time_cuda(run, 3)
        except Exception as ex:  # noqa: BLE001
            out["tiles"][str(tile)] = {"error": repr(ex)}
            continue
        out["tiles"][str(tile)] = {"graph_ms": g, "eager_ms": e, "written_gb_s": written / g / 1e6,
                                   "total_gb_s": (written + read) / g / 1e6}
        print(f"dequant tile {tile}: {g:.2f} ms GPU ({written / g / 1e6:.0f} GB/s written), {e:.2f} ms eager",
              flush=True)
    ok = {t: v for t, v in out["tiles"].items() if "graph_ms" in v}
    out["best"] = min(ok, key=lambda t: ok[t]["graph_ms"])
    # the GEMMs alone at T = 512 (graph replay), on one dequantized buffer per shape
    x = {K: torch.randn(512, K, device=model.device).to(buf.dtype) for K in {u.K for u in units}}
    ws = {}
    for u in units:
        if (u.n, u.K) not in ws:
            ws[(u.n, u.K)] = u.dequantize(torch.empty(u.n * u.K, dtype=buf.dtype, device=model.device), OLD_TILE)
    flop = 2 * 512 * sum(u.n * u.K for u in units)
    s = model.scratch
    for name, mm in (("fp32_out", lambda a, w: s.mm(a, w)), ("bf16_out", lambda a, w: a @ w.T)):
        try:
            ms = _graph_ms(lambda: [mm(x[u.K], ws[(u.n, u.K)]) for u in units])  # noqa: B023
            out[f"gemm_512_{name}_ms"], out[f"gemm_512_{name}_tflops"] = ms, flop / ms / 1e9
            print(f"GEMMs alone at 512 rows ({name}): {ms:.2f} ms, {flop / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as ex:  # noqa: BLE001
            out[f"gemm_512_{name}_error"] = repr(ex)
    return out


def _profile(run) -> dict:
    """Device time per kernel name over one call (torch.profiler), the top 15."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    ev.sort(key=lambda e: -e.self_device_time_total)
    return {"device_ms_total": sum(e.self_device_time_total for e in ev) / 1000,
            "top": [{"name": e.key[:120], "count": e.count, "device_ms": e.self_device_time_total / 1000}
                    for e in ev[:15]]}


def prefill_arms(path: str, sizes: list[int], n_gen: int = 16, gemv: bool = False) -> dict:
    """Prefill ms per arm and size (ARMS, plus the decode-graph path with gemv=True); the
    dequantize pass alone per tile; where one chunk's device time goes; each path's
    greedy tokens after one prompt."""
    from alphallama.gguf.reader import GGUFFile
    from alphallama.runtime.gpu_model import GPUModel
    ctx = max(sizes + [600]) + n_gen + 64
    t0 = time.perf_counter()
    model = GPUModel(GGUFFile(path), ctx, "cuda")
    cache = model.new_cache(ctx)                         # captures the decode graphs
    out: dict = {"load_and_capture_s": time.perf_counter() - t0,
                 "scratch_mib": model.scratch.elements * torch.empty(0, dtype=model.scratch.dtype).element_size() >> 20}
    try:
        out["dequant"] = dequant_sweep(model)
        best = ast.literal_eval(out["dequant"]["best"])
    except Exception as e:  # noqa: BLE001
        out["dequant"], best = {"error": repr(e)}, OLD_TILE
    out["best_tile"] = best
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(model.cfg.vocab_size, (max(sizes),), generator=g)
    hidden = {}
    arms = ARMS + ([("gemv", False, OLD_TILE, 512, None, False)] if gemv else [])
    for name, overlap, tile, chunk, only, graphs in arms:
        model.prefill_path = "gemv" if name == "gemv" else "dequant"
        model.scratch.overlap, model.scratch.tile, model.prefill_chunk = overlap, tile or best, chunk
        model.scratch.graphs = graphs
        model.scratch.captured.clear()
        out[name] = {"overlap": overlap, "tile": tile or best, "chunk": chunk, "graphs": graphs}
        for n in (only or sizes):
            def run():
                cache.length = 0
                return model.forward(ids[:n], 0, cache, logits=False)[1]
            try:                                         # one device call: a failure must not lose the rest
                t1 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t1       # includes Triton compiles (and graph capture) on first use
                out[name]["graphs_active"] = model.scratch.graphs   # False after a capture that failed (warned)
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                h = run()
                enq = time.perf_counter() - t1           # host time to issue the call
                torch.cuda.synchronize()
                wall = time.perf_counter() - t1
                if n == 512:
                    hidden[name] = h.clone()
                ms = time_cuda(run, 3 if n > 1024 else 5, warm=1)
            except Exception as e:  # noqa: BLE001
                out[name][str(n)] = {"error": repr(e), "tok_s": float("nan")}
                print(f"prefill {name} {n}: FAILED {e!r}", flush=True)
                continue
            out[name][str(n)] = {"ms": ms, "tok_s": n / ms * 1000, "ms_per_chunk": ms / -(-n // chunk),
                                 "first_call_s": first_s, "host_issue_ms": enq * 1000, "one_call_ms": wall * 1000}
            print(f"prefill {name:14s} {n:5d}: {ms:8.1f} ms {n / ms * 1000:8.0f} tok/s "
                  f"(host issues it in {enq * 1000:.1f} ms)", flush=True)
    ref = hidden.get("serial")     # graphs: cuBLAS may choose another kernel under capture (then not equal)
    out["bitwise_equal_to_serial_512"] = {k: bool(torch.equal(v, ref)) for k, v in hidden.items()
                                          if ref is not None and k not in ("serial", "gemv")}
    out["mm_out_dtype_fp32"] = model.scratch.mm_out_dtype
    model.prefill_path, model.prefill_chunk = "dequant", 512
    model.scratch.tile = best
    for name, overlap, graphs in (("graphs", False, True), ("serial", False, False)):
        model.scratch.overlap, model.scratch.graphs = overlap, graphs
        try:
            out[f"profile_{name}_512"] = _profile(lambda: model.forward(ids[:512], 0, cache, logits=False))
        except Exception as e:  # noqa: BLE001
            out[f"profile_{name}_512"] = {"error": repr(e)}
    # the defaults from here on (the generation check below runs the engine's settings)
    from alphallama.runtime.overrides import PRODUCT
    model.scratch.overlap, model.scratch.graphs = PRODUCT.prefill_overlap, PRODUCT.prefill_graphs
    model.scratch.captured.clear()
    # greedy continuation of one prompt (prompt rows but the last by the path, the last
    # row and every generated token by W = 1 rounds, as engine.prefill does)
    prompt = torch.randint(model.cfg.vocab_size, (600,), generator=g)
    for key, graphs in (("generation", model.scratch.graphs), ("generation_graphs", True)):
        model.scratch.graphs = graphs
        try:
            out[key] = _generation(model, cache, prompt, n_gen)
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": repr(e), "equal": None, "first_equal": None}
    model.prefill_path = "dequant"
    model = cache = None    # the closures above hold these cells: clear them so empty_cache can free the model
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
    ap.add_argument("--gemv", action="store_true", help="also time prefill through the decode graphs (slow)")
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
    res["prefill"] = prefill_arms(path, args.prefill, gemv=args.gemv)
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
    print("\narm             " + "".join(f"{n:>10d}" for n in args.prefill) + "   (tok/s)")
    for name, *_ in ARMS + [("gemv",)]:
        if name in p:
            print(f"{name:14s}  " + "".join(f"{p[name].get(str(n), {}).get('tok_s', float('nan')):10.0f}"
                                          for n in args.prefill))
    d = p.get("dequant", {})
    for t, v in d.get("tiles", {}).items():
        print(f"dequantize pass, tile {t}: {v.get('graph_ms', float('nan')):.2f} ms GPU, "
              f"{v.get('written_gb_s', float('nan')):.0f} GB/s written; eager {v.get('eager_ms', float('nan')):.2f} ms")
    print(f"best tile {p.get('best_tile')}; bitwise equal to serial at 512: {p.get('bitwise_equal_to_serial_512')}; "
          f"greedy tokens equal (dequant vs gemv): {p['generation'].get('equal')} "
          f"(first: {p['generation'].get('first_equal')}; with graphs: {p['generation_graphs'].get('equal')}); "
          f"spec == plain: {res['spec_exactness']['all_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

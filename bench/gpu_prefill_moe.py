"""Where a resident-expert MoE prefill chunk's time goes (device run, one call).

    python3 bench/gpu_prefill_moe.py --preset qwen3-30b-a3b --commit HASH

For prompt sizes x chunk sizes through the tensor-core path with the experts as
grouped GEMMs (moe_gemm.moe_prefill: "fused", "fused_graphs" with the chunk captured),
the per-expert loop ("loop", MOE_FUSED off; the batched experts it replaced are in
the committed JSON of 20261130-0846) and through the decode graphs ("gemv"):
ms per call (CUDA events, after a warm call) and the host's time to issue it; moe_prefill's
tiles on one layer; then one
512-row chunk under torch.profiler: the top kernels by device time and the top host
ops by self CPU time; and one MoE layer alone (moe_grouped at T rows), host and device.
JSON under $OUT; a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.engine_bench import time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.writer import PRESETS, write_synthetic

# (arm, chunk, prompt rows): "fused" = moe_gemm.moe_prefill (graphs: the chunk captured),
# "loop" = gpu_prefill.moe_loop (one host sync a layer, ~8 launches an expert), "gemv" = the decode graphs
CASES = [(a, 512, n) for a in ("fused_graphs", "fused") for n in (128, 512)] + \
        [("fused_graphs", 512, n) for n in (100, 256, 300)] + \
        [("fused_graphs", 1024, 1024), ("fused_graphs", 512, 4096), ("fused_graphs", 2048, 4096),
         ("fused", 2048, 4096), ("loop", 512, 512), ("gemv", 512, 128), ("gemv", 512, 512)]
TILES = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 8, 4), (32, 4, 3), (128, 4, 4), (64, 4, 2)]


def _profile(run) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ev = list(prof.key_averages())
    dev = sorted((e for e in ev if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
    host = sorted(ev, key=lambda e: -e.self_cpu_time_total)
    return {"device_ms_kernels": sum(e.self_device_time_total for e in dev if not e.key.startswith("aten::")) / 1000,
            "top_device": [{"name": e.key[:100], "count": e.count, "ms": e.self_device_time_total / 1000}
                           for e in dev[:14]],
            "host_ms_total": sum(e.self_cpu_time_total for e in ev) / 1000,
            "top_host": [{"name": e.key[:100], "count": e.count, "self_ms": e.self_cpu_time_total / 1000}
                         for e in host[:16]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--arms", nargs="*", default=None, help="only these arms of CASES")
    ap.add_argument("--no-tiles", action="store_true")
    args = ap.parse_args()
    from alphallama.gguf.reader import GGUFFile
    from alphallama.runtime import gpu_prefill as gp
    from alphallama.runtime.gpu_model import GPUModel
    from alphallama.runtime.overrides import Overrides
    path = "/tmp/synth_moe.gguf"
    overrides = {"n_layers": args.layers} if args.layers else {}
    t0 = time.perf_counter()
    write_synthetic(PRESETS[args.preset](**overrides), path)
    res: dict = {"host": host_state(sys.argv), "commit": args.commit, "preset": args.preset,
                 "overrides": overrides, "write_s": time.perf_counter() - t0}
    out = Path(os.environ.get("OUT", ".")) / f"gpu_prefill_moe-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save = lambda: out.write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    ctx = 4096 + 128
    model = GPUModel(GGUFFile(path), ctx, "cuda", overrides=Overrides(prefill_path="dequant"))
    cache = model.new_cache(ctx)
    ids = torch.randint(model.cfg.vocab_size, (4096,), generator=torch.Generator().manual_seed(11))
    res["cases"] = []
    hidden = {}
    for path_name, chunk, n in [c for c in CASES if args.arms is None or c[0] in args.arms]:
        model.prefill_path, model.prefill_chunk = ("gemv" if path_name == "gemv" else "dequant"), chunk
        gp.MOE_FUSED = path_name.startswith("fused")
        model.scratch.graphs = path_name == "fused_graphs"
        model.scratch.captured.clear()

        def run(n=n):
            cache.length = 0
            return model.forward(ids[:n], 0, cache, logits=False)[1]
        try:
            run()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            h_out = run()
            host = time.perf_counter() - t1
            if n == 512:
                hidden[path_name] = h_out.float().clone()
            torch.cuda.synchronize()
            ms = time_cuda(run, 3, warm=0)
        except Exception as e:  # noqa: BLE001
            res["cases"].append({"path": path_name, "chunk": chunk, "n": n, "error": repr(e)})
            print(f"{path_name:8s} chunk {chunk:5d} n {n:5d}: FAILED {e!r}", flush=True)
            continue
        res["cases"].append({"path": path_name, "chunk": chunk, "n": n, "ms": ms, "tok_s": n / ms * 1000,
                             "host_issue_ms": host * 1000})
        print(f"{path_name:8s} chunk {chunk:5d} n {n:5d}: {ms:8.1f} ms {n / ms * 1000:8.0f} tok/s "
              f"(host issues it in {host * 1000:.1f} ms)", flush=True)
        save()
    ref = hidden.get("loop")
    res["max_rel_diff_to_loop_512"] = {k: ((v - ref).abs().max() / ref.abs().max()).item()
                                       for k, v in hidden.items() if ref is not None and k != "loop"}
    res["fused_graphs_bitwise_equal_fused_512"] = (bool(torch.equal(hidden["fused"], hidden["fused_graphs"]))
                                                   if {"fused", "fused_graphs"} <= hidden.keys() else None)
    print("max |diff| / max |loop| at 512:", res["max_rel_diff_to_loop_512"],
          "graphs == eager:", res["fused_graphs_bitwise_equal_fused_512"], flush=True)
    model.prefill_path, model.prefill_chunk = "dequant", 512
    gp.MOE_FUSED, model.scratch.graphs = True, False
    cache.length = 0
    res["profile_512"] = _profile(lambda: model.forward(ids[:512], 0, cache, logits=False))
    save()
    # one MoE layer alone at T rows: host issue time and device time; moe_prefill's tiles at 512
    L = next(L for L in model.layers if L.moe is not None)
    from alphallama.kernels.moe.route import moe_route
    from alphallama.kernels.moe.moe_gemm import moe_prefill
    from alphallama.kernels.gemv.qmatmul import qmatmul
    h = torch.randn(512, model.cfg.d_model, device="cuda").to(model.scratch.dtype)
    wts, exps = moe_route(qmatmul(h, L.moe.router, rows_per_thread=4), L.moe.top_k, L.moe.norm)
    res["tiles_512"] = {}
    for tile in ([] if args.no_tiles else TILES):
        try:
            ms = time_cuda(lambda tile=tile: moe_prefill(h, wts, exps, L.moe.gate_up, L.moe.down, tile), 10, warm=2)
        except Exception as e:  # noqa: BLE001
            res["tiles_512"][str(tile)] = {"error": repr(e)[:300]}
            print(f"moe_prefill tile {tile}: FAILED {e!r}"[:300], flush=True)
            continue
        res["tiles_512"][str(tile)] = {"ms": ms}
        print(f"moe_prefill tile {tile}: {ms:.3f} ms a layer at 512 rows", flush=True)
    save()
    res["moe_layer"] = {}
    for T in (128, 512, 1024):
        h = torch.randn(T, model.cfg.d_model, device="cuda").to(model.scratch.dtype)
        fn = lambda h=h: gp.moe_grouped(L.moe, h, model.scratch, 4)  # noqa: E731  (MOE_FUSED)
        fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        fn()
        host = time.perf_counter() - t1
        torch.cuda.synchronize()
        ms = time_cuda(fn, 5, warm=1)
        res["moe_layer"][T] = {"ms": ms, "host_issue_ms": host * 1000}
        print(f"one MoE layer, T {T:5d}: {ms:.3f} ms (host {host * 1000:.3f} ms)", flush=True)
    save()
    p = res["profile_512"]
    print(f"profile 512: kernels {p['device_ms_kernels']:.1f} ms device, host ops {p['host_ms_total']:.1f} ms")
    for e in p["top_device"][:10]:
        print(f"  dev  {e['ms']:7.2f} ms x{e['count']:5d} {e['name'][:70]}")
    for e in p["top_host"][:12]:
        print(f"  host {e['self_ms']:7.2f} ms x{e['count']:5d} {e['name'][:70]}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

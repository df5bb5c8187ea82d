"""`alphallama bench-engine -m MODEL`: what a decode round costs on the GPU.

Figures (DESIGN §8): ms per round at every width bucket (graph replay, uninstrumented,
CUDA events), with graphs off at a few widths as the same-session control arm; prefill
tok/s at 512 and 4096 tokens; the bandwidth floor (active bytes per token / measured
device copy bandwidth) beside every decode figure; and the column-rotation check at
real size (every row of a W-row round bit-identical to the same row run alone).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-c", "--ctx-size", type=int, default=8192)
    p.add_argument("--depth", type=int, default=512, help="context depth at which rounds are timed")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--prefill", type=int, nargs="*", default=[512, 4096])
    p.add_argument("--rotation-widths", type=int, nargs="*", default=[1, 2, 3, 5, 8, 13, 16, 33, 64])
    p.add_argument("--out", default=None, help="JSON file (default: print only)")


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        y.copy_(x)
    t1.record()
    torch.cuda.synchronize()
    return 2 * nbytes * reps / (t0.elapsed_time(t1) / 1000)


def time_cuda(fn, reps: int, warm: int = 2) -> float:
    """Mean ms of fn() over reps, after `warm` warm-up calls (CUDA events)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / reps


def kv_bytes_per_token(cfg, depth: int) -> int:
    return cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2 * depth   # fp16 K and V read once


def rotation_check(model, cache, depth: int, widths: list[int], vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for W in widths:
        rows = torch.randint(vocab, (W,), generator=g)
        cache.length = depth
        a, _ = model.verify(rows, depth, cache)
        a = a.clone()
        cache.truncate(depth)
        same = True
        for i in range(W):
            one, _ = model.forward(rows[i:i + 1], depth + i, cache)
            same &= bool(torch.equal(one[0], a[i]))
        out[W] = same
    return out


def control_gemv(f, ctx: int, depth: int, reps: int, gemv: str) -> dict:
    """ms per round at W=1 and W=8 with the other dense GEMV (the same-session control arm)."""
    from ..runtime.gpu_model import GPUModel
    from ..runtime.overrides import Overrides
    model = GPUModel(f, ctx, "cuda", overrides=Overrides(decode_gemv=gemv))
    cache = model.new_cache(ctx)
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(model.cfg.vocab_size, (depth,), generator=g), 0, cache)
    out = {}
    for b in (1, 8):
        graph = model.graphs[b][0]

        def replay():
            model._pos.fill_(depth)
            graph.replay()
        out[b] = time_cuda(replay, reps)
    return {"decode_gemv": gemv, "ms_per_round": out}


def bench(model_path: str, ctx: int, depth: int, reps: int, prefill: list[int], rot_widths: list[int],
          control: bool = True) -> dict:
    from ..gguf.reader import GGUFFile
    from ..runtime.gpu_model import BUCKETS, GPUModel
    t0 = time.perf_counter()
    f = GGUFFile(model_path)
    model = GPUModel(f, ctx, "cuda")
    load_s = time.perf_counter() - t0
    cache = model.new_cache(ctx)            # captures the graphs
    cfg = model.cfg
    bw = copy_bandwidth()
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(cfg.vocab_size, (depth,), generator=g), 0, cache)
    toks = torch.randint(cfg.vocab_size, (64,), generator=g).cuda()
    rounds = {}
    for b in BUCKETS:
        graph = model.graphs[b][0]

        def replay():
            model._pos.fill_(depth)
            graph.replay()
        rounds[b] = time_cuda(replay, reps)
    eager = {}
    for b in (1, 8):
        def run_eager():
            model._pos.fill_(depth)
            model._rows(toks[:b], model._pos, cache)
        eager[b] = time_cuda(run_eager, max(5, reps // 5))
    weight_bytes = model.weight_bytes
    active = weight_bytes + kv_bytes_per_token(cfg, depth)
    floor_ms = active / bw * 1000
    pre = {}
    for n in prefill:
        if n + 1 > ctx:
            continue
        c2 = model.cache
        ids = torch.randint(cfg.vocab_size, (n,), generator=g)
        c2.length = 0

        def do_prefill():
            c2.length = 0
            model.forward(ids, 0, c2)
        ms = time_cuda(do_prefill, 3)
        pre[n] = {"ms": ms, "tok_s": n / ms * 1000, "prefill_path": model.prefill_path,   # runs on different
                  "prefill_chunk": model.prefill_chunk}                                 # paths told apart
    rot = rotation_check(model, cache, depth, rot_widths, cfg.vocab_size)
    gemv, capture_s = model.decode_gemv, model.capture_s
    ctl = None
    if control:
        del model, cache
        torch.cuda.empty_cache()
        ctl = control_gemv(f, ctx, depth, reps, "f32" if gemv == "i8" else "i8")
    return {
        "model": model_path, "config": cfg.__dict__, "ctx": ctx, "depth": depth,
        "load_s": load_s, "graph_capture_s": capture_s,
        "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "active_bytes_per_token": active,
        "floor_ms_per_token": floor_ms, "floor_tok_s": 1000 / floor_ms,
        "ms_per_round": rounds,
        "tok_s_plain": 1000 / rounds[1], "share_of_floor_plain": floor_ms / rounds[1],
        "achieved_GBps_plain": active / rounds[1] / 1e6,
        "w8_over_w1": rounds[8] / rounds[1],
        "eager_ms_per_round": eager, "graph_speedup": {b: eager[b] / rounds[b] for b in eager},
        "prefill": pre, "rotation_bitwise_equal": rot,
        "decode_gemv": gemv, "control_gemv": ctl,
        "control_ratio": {b: ctl["ms_per_round"][b] / rounds[b] for b in (1, 8)} if ctl else None,
    }


def run(args) -> int:
    from .hostinfo import host_state
    if not torch.cuda.is_available():
        print("alphallama: error: bench-engine needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"host": host_state(sys.argv), **bench(args.model, args.ctx_size, args.depth, args.reps, args.prefill,
                                                  args.rotation_widths)}
    print(f"{'W':>4} {'ms/round':>9} {'tok/s if all accepted':>22}")
    for w, ms in res["ms_per_round"].items():
        print(f"{w:>4} {ms:9.3f} {w / ms * 1000:22.0f}")
    print(f"plain {res['tok_s_plain']:.0f} tok/s = {100 * res['share_of_floor_plain']:.0f}% of the floor "
          f"({res['floor_tok_s']:.0f} tok/s at {res['copy_bandwidth_GBps']:.0f} GB/s); W8/W1 {res['w8_over_w1']:.2f}; "
          f"graphs x{res['graph_speedup'][1]:.2f}; {res['decode_gemv']} GEMV vs control "
          f"{res['control_gemv']['decode_gemv'] if res['control_gemv'] else '-'}: x{res['control_ratio']}; prefill {res['prefill']}; rotation {res['rotation_bitwise_equal']}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0 if all(res["rotation_bitwise_equal"].values()) else 1

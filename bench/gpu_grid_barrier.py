"""What a persistent per-layer kernel would pay (docs/decisions/decode-cost-model.md): S stages that each
read B bytes of "weights", run (a) as S kernels chained with PDL, the round's structure
now; (b) as one persistent kernel, one CTA per SM, with a grid-wide barrier between the
stages (one gpu-scope release atomic a CTA, then a spin on acquire loads); (c) as (b),
but each CTA loads its share of the next stage before it spins (the weights are no
stage's output, so a barrier need not wait for them); (d) as (a), but each kernel spins
on its predecessor's per-CTA arrivals instead of the PDL wait (whole grid completed and
flushed). B=0 gives the synchronisation alone.

    GIT_COMMIT=... python bench/gpu_grid_barrier.py [--stages 12] [--mb 1 4 16]
    TRITON_INTERPRET=1 python bench/gpu_grid_barrier.py --device cpu   # a smoke run: one CTA, tiny sizes

Prints us per stage for each form; writes $OUT/gpu_grid_barrier-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from alphallama.kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402

BLOCK = 1024          # int32 words a CTA reads per step


@triton.jit
def _read(buf, base, N: tl.constexpr, acc, BLOCK: tl.constexpr):
    """acc + the N words from base, BLOCK at a time (N a constexpr: the interpreter cannot
    take a run-time range bound under numpy 2.4, docs/decisions/triton-interpreter-numpy.md)."""
    offs = tl.arange(0, BLOCK)
    for i in range(0, N, BLOCK):
        acc += tl.load(buf + base + i + offs)
    return acc


@triton.jit
def _grid_barrier(cnt, target):
    """Every CTA's stores so far before its one release arrival; then spin until `target`
    arrivals (acquire: the other CTAs' stores are visible after it)."""
    tl.debug_barrier()
    tl.atomic_add(cnt, 1, sem="release", scope="gpu")
    _spin_until(cnt, target)
    tl.debug_barrier()


@triton.jit
def _spin_until(ptr, target):
    """Until *ptr >= target (acquire loads: Triton issues them from one thread and
    broadcasts the value through shared memory)."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _persistent_kernel(buf, cnt, out, per_cta: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr,
                       AHEAD: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    stage_words = per_cta * G
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    nxt = tl.load(buf + pid * per_cta + offs)                # stage 0's first block
    for s in range(S):
        base = s * stage_words + pid * per_cta
        if AHEAD:
            acc += nxt                                       # this stage's first block, loaded before the spin
            acc = _read(buf, base + BLOCK, per_cta - BLOCK, acc, BLOCK)
            if s + 1 < S:
                nxt = tl.load(buf + base + stage_words + offs)
        else:
            acc = _read(buf, base, per_cta, acc, BLOCK)
        _grid_barrier(cnt, (s + 1) * G)
    tl.store(out + pid * BLOCK + offs, acc)


@triton.jit
def _stage_kernel(buf, out, flags, epoch_ptr, per_cta: tl.constexpr, s, BLOCK: tl.constexpr, PDL: tl.constexpr,
                  FLAGS: tl.constexpr):
    """One stage as its own kernel (the chain), launched early by PDL: its first block
    (weights) before it waits. It waits with the PDL wait (the whole previous grid
    completed and flushed) or, FLAGS, by spinning until every CTA of the previous stage
    has arrived on flags[s] (epoch x CTAs arrivals: the flags count up across calls),
    arriving on flags[s + 1] when done."""
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    base = s * per_cta * G + pid * per_cta
    acc = tl.load(buf + base + offs)
    if not FLAGS:
        pdl_wait(PDL)
    elif s > 0:
        _spin_until(flags + s, tl.load(epoch_ptr) * G)
    acc = _read(buf, base + BLOCK, per_cta - BLOCK, acc, BLOCK)
    tl.store(out + pid * BLOCK + offs, tl.load(out + pid * BLOCK + offs, cache_modifier=".cg") + acc)
    if FLAGS:
        tl.debug_barrier()
        tl.atomic_add(flags + s + 1, 1, sem="release", scope="gpu")


def timed(fn, reps: int, device: str) -> float:
    """us per call: a CUDA graph of the call, replayed `reps` times (the CPU: one eager call)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=12)
    ap.add_argument("--mb", type=float, nargs="*", default=[0.0, 1.0, 4.0, 16.0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    G = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 1
    S = args.stages
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": os.environ.get("GIT_COMMIT"), "ctas": G,
           "stages": S, "command": " ".join(sys.argv), "rows": []}
    if dev == "cuda":
        from gpu_kernels import run_header
        res.update(run_header(torch.cuda.get_device_properties(0)))
    for mb in args.mb:
        per_cta = max(2 * BLOCK, int(mb * (1 << 20) / 4 / G) // BLOCK * BLOCK)   # int32 words, >= 2 blocks
        if dev != "cuda":
            per_cta = 2 * BLOCK
        # 4 copies of the S stages, cycled, so L2 (50 MB) holds none of what a call reads
        copies = [torch.randint(0, 7, (S * per_cta * G + BLOCK,), dtype=torch.int32, device=dev) for _ in range(4)]
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(G * BLOCK, dtype=torch.int32, device=dev)
        row = {"MB_per_stage": per_cta * G * 4 / 2 ** 20, "us": {}}
        it = iter(range(10 ** 9))
        flags = torch.zeros(S + 1, dtype=torch.int32, device=dev)      # the flag-chained form's arrivals
        epoch = torch.zeros(1, dtype=torch.int32, device=dev)

        def chain(pdl):
            buf = copies[next(it) % 4]
            for s in range(S):
                _stage_kernel[(G,)](buf, out, flags, epoch, per_cta=per_cta, s=s, BLOCK=BLOCK,
                                    PDL=pdl and dev == "cuda", FLAGS=False,
                                    **({"launch_pdl": True} if pdl and dev == "cuda" else {}))

        def chain_flags():
            buf = copies[next(it) % 4]
            epoch.add_(1)              # (a plain launch: stage 0 starts after it)
            for s in range(S):
                _stage_kernel[(G,)](buf, out, flags, epoch, per_cta=per_cta, s=s, BLOCK=BLOCK, PDL=dev == "cuda",
                                    FLAGS=True, **({"launch_pdl": True} if dev == "cuda" else {}))

        def persistent(ahead, buf=None):
            buf = copies[next(it) % 4] if buf is None else buf
            cnt.zero_()
            _persistent_kernel[(G,)](buf, cnt, out, per_cta=per_cta, S=S, BLOCK=BLOCK, AHEAD=ahead)

        for name, fn in (("chain", lambda: chain(False)), ("chain_pdl", lambda: chain(True)),
                         ("chain_flags", chain_flags), ("persistent", lambda: persistent(False)),
                         ("persistent_ahead", lambda: persistent(True))):
            row["us"][name] = timed(fn, args.reps, dev) / S                  # per stage
        # loading ahead reads the same words: the same sums
        out.zero_()
        persistent(False, copies[0])
        p = out.clone()
        out.zero_()
        persistent(True, copies[0])
        row["ahead_equal"] = bool(torch.equal(p, out))
        res["rows"].append(row)
        print(f"{row['MB_per_stage']:7.2f} MB/stage  " + "  ".join(f"{k} {v:7.2f}" for k, v in row["us"].items())
              + f" us/stage  ahead_equal {row['ahead_equal']}", flush=True)
    if dev == "cuda":
        p = Path(os.environ.get("OUT", ".")) / f"gpu_grid_barrier-{time.strftime('%Y%m%d-%H%M%S')}.json"
        p.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Can a GEMV read its weights while the kernel before it still runs (PDL)?

The decode round's parts add up to the round (session 22's ablation: GEMVs alone 1.462 ms
+ the rest alone 0.506 = 1.968 against a 1.962 round): nothing overlaps, although every
GEMV loads its first step before griddepcontrol.wait. Here a latency-bound predecessor
(A: 16 programs, each spinning SPIN ns on %globaltimer, like a norm or the attention
combine) is followed by a streaming kernel B over an o-sized weight (4096 rows of 2304
bytes, Q4_K's 8B o) whose programs each hold 4 whole rows in registers (1,024 programs; the
timeline says how many are resident before A ends), so every byte could be in registers
before the wait. Arms:

  post  wait, then load the whole tile (nothing before the wait)
  pre   load the whole tile, then wait (all of B's bytes fetched during A)

timed as a CUDA graph of R (A, B) pairs with PDL launches, against A alone and B alone;
and from one replay, B's programs' entry times relative to A's end (%globaltimer): how
many were resident before A finished. $OUT/gpu_pdl_overlap-*.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import L2_BYTES, run_header, time_graph  # noqa: E402

from alphallama.kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402
from alphallama.kernels.qmatvec_i8 import _dp4a  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(t_end, SPIN: tl.constexpr, PDL: tl.constexpr):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t0 = _now()
    t = t0
    while t - t0 < SPIN:
        t = _now()
    tl.store(t_end + tl.program_id(0), t)


@triton.jit
def _consume(v, acc):
    acc = _dp4a(v & 0x0F0F0F0F, tl.full(v.shape, 0x01010101, tl.int32), acc, True)
    return _dp4a((v >> 4) & 0x0F0F0F0F, tl.full(v.shape, 0x01020102, tl.int32), acc, True)


@triton.jit
def _stream_kernel(w, out, t_in, t_go, N, KW: tl.constexpr, BN: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
    """A program: BN whole rows of 576 words as a [BN, 512] and a [BN, 64] tile (no padding,
    so the bytes a program holds are its rows' bytes)."""
    tl.static_assert(KW == 576)
    pid = tl.program_id(0)
    tl.store(t_in + pid, _now())
    pdl_trigger(PDL)
    rows = pid * BN + tl.arange(0, BN)
    ptr = w + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * KW
    p1 = ptr + tl.arange(0, 512)[None, :]
    p2 = ptr + 512 + tl.arange(0, 64)[None, :]
    if PRE:
        v1 = tl.load(p1)                                                  # [BN, 512]
        v2 = tl.load(p2)                                                  # [BN, 64]
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        v1 = tl.load(p1)
        v2 = tl.load(p2)
    tl.store(t_go + pid, _now())
    y = tl.sum(_consume(v1, tl.zeros_like(v1)), 1) + tl.sum(_consume(v2, tl.zeros_like(v2)), 1)
    tl.store(out + rows, y, mask=rows < N)


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "arms": {}}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_pdl_overlap-{time.strftime('%Y%m%d-%H%M%S')}.json"
    N, KW, BN = 4096, 576, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    n_copies = max(8, -(-4 * L2_BYTES // (N * KW * 4)))
    mats = [torch.randint(-2**31, 2**31 - 1, (N, KW), dtype=torch.int32, device="cuda", generator=g)
            for _ in range(n_copies)]
    out = torch.empty(N, dtype=torch.int32, device="cuda")
    t_end = torch.zeros(16, dtype=torch.int64, device="cuda")
    t_in = torch.zeros(N // BN, dtype=torch.int64, device="cuda")
    t_go = torch.zeros_like(t_in)
    grid = (N // BN,)
    print(f"{props.name}: B = {N} x {KW * 4} bytes ({N * KW * 4 / 1e6:.1f} MB), {grid[0]} programs", flush=True)
    for spin in (2000, 4000):
        A = lambda: _spin_kernel[(16,)](t_end, SPIN=spin, PDL=True, launch_pdl=True)  # noqa: E731
        row = {"A_us": time_graph([A for _ in mats]) * 1e6}
        for pre in (0, 1):
            B = [lambda m=m, pre=pre: _stream_kernel[grid](m, out, t_in, t_go, N, KW=KW, BN=BN, PRE=pre, PDL=True,
                                                            launch_pdl=True) for m in mats]
            row[f"B{pre}_us"] = time_graph(B) * 1e6
            pair = [f for m_b in B for f in (A, m_b)]
            row[f"AB{pre}_us"] = time_graph(pair) * 2e6               # per (A, B) pair
            # one pair's timeline, from a graph replay (eager launches would add the host's gaps)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                A()
                B[0]()
            gr.replay()
            torch.cuda.synchronize()
            a_end = int(t_end.max())
            ins = (t_in - a_end).float() / 1e3                        # us after A's last program ended
            gos = (t_go - a_end).float() / 1e3
            row[f"B{pre}_entry_us"] = {"min": float(ins.min()), "median": float(ins.median()), "max": float(ins.max()),
                                       "share_before_A_end": float((ins < 0).float().mean())}
            row[f"B{pre}_go_us"] = {"min": float(gos.min()), "median": float(gos.median()), "max": float(gos.max())}
        res["arms"][f"spin{spin}"] = row
        print(f"spin {spin} ns: A {row['A_us']:.2f} us | B post {row['B0_us']:.2f} pre {row['B1_us']:.2f} | "
              f"A+B post {row['AB0_us']:.2f} pre {row['AB1_us']:.2f} | entries before A's end: post "
              f"{row['B0_entry_us']['share_before_A_end']:.2f} pre {row['B1_entry_us']['share_before_A_end']:.2f}; "
              f"B entry median {row['B1_entry_us']['median']:.2f} us, go median post "
              f"{row['B0_go_us']['median']:.2f} pre {row['B1_go_us']['median']:.2f} us", flush=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Can a GEMV read its weights while the kernel before it still runs (PDL), and does the
kernel after it start on time?

The decode round's parts add up to the round (session 22's ablation: GEMVs alone 1.462 ms
+ the rest alone 0.506 = 1.968 against a 1.962 round): nothing overlaps, although every
GEMV loads its first step before griddepcontrol.wait. Here a latency-bound kernel A (16
programs spinning SPIN ns on %globaltimer, like a norm or the attention combine) and a
streaming kernel B over an o-sized weight (4096 rows of 2304 bytes, Q4_K's 8B o, in
blocks of 4 whole rows held in registers) alternate in a PDL graph. B's forms:

  post     1,024 programs, a block each, loaded after the wait
  pre      the same, loaded before the wait (all of B's bytes can arrive during A)
  persP    P programs walking 1024 / P blocks, the first before the wait, the next block
           loaded while one is summed (fewer CTAs an SM: room for the next A)

Times: B alone, the (A, B) pair less A alone; and from one replay of A, B, A, when B's
programs enter and pass the wait (from the first A's end), and when the second A's do
(from B's end). $OUT/gpu_pdl_overlap-*.json.
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
from alphallama.kernels.gemv.qmatvec_i8 import dp4a  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ts, SPIN: tl.constexpr, PDL: tl.constexpr):
    """ts [3, programs]: entry, past the wait, exit (%globaltimer, ns)."""
    _spin(ts, tl.program_id(0), tl.num_programs(0), SPIN, PDL)


@triton.jit
def _spin(ts, pid, P, SPIN: tl.constexpr, PDL: tl.constexpr):
    """Program pid of P: stamp its entry, trigger and wait (PDL), spin SPIN ns, stamp both."""
    tl.store(ts + pid, _now())
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t0 = _now()
    tl.store(ts + P + pid, t0)
    t = t0
    while t - t0 < SPIN:
        t = _now()
    tl.store(ts + 2 * P + pid, t)


@triton.jit
def _consume(v, acc):
    acc = dp4a(v & 0x0F0F0F0F, tl.full(v.shape, 0x01010101, tl.int32), acc, True)
    return dp4a((v >> 4) & 0x0F0F0F0F, tl.full(v.shape, 0x01020102, tl.int32), acc, True)


@triton.jit
def _rows(w, blk, N, KW: tl.constexpr, BN: tl.constexpr):
    rows = blk * BN + tl.arange(0, BN)
    return w + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * KW, rows


@triton.jit
def _stream_kernel(w, out, ts, N, KW: tl.constexpr, BN: tl.constexpr, PER: tl.constexpr, PRE: tl.constexpr,
                   PDL: tl.constexpr):
    """A program: PER blocks of BN whole rows (blocks pid, pid + G, ...), each row of 576
    words as a [BN, 512] and a [BN, 64] tile (no padding: the bytes held are the rows'
    bytes), the next block loaded while one is summed. PRE: the first block loaded before
    the wait. ts as _spin_kernel's."""
    tl.static_assert(KW == 576)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    tl.store(ts + pid, _now())
    pdl_trigger(PDL)
    ptr, rows = _rows(w, pid, N, KW, BN)
    if PRE:
        v1 = tl.load(ptr + tl.arange(0, 512)[None, :])                   # [BN, 512]
        v2 = tl.load(ptr + 512 + tl.arange(0, 64)[None, :])              # [BN, 64]
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        v1 = tl.load(ptr + tl.arange(0, 512)[None, :])
        v2 = tl.load(ptr + 512 + tl.arange(0, 64)[None, :])
    tl.store(ts + G + pid, _now())
    for j in tl.static_range(PER):
        if j + 1 < PER:
            nptr, nrows = _rows(w, pid + (j + 1) * G, N, KW, BN)
            n1 = tl.load(nptr + tl.arange(0, 512)[None, :])
            n2 = tl.load(nptr + 512 + tl.arange(0, 64)[None, :])
        y = tl.sum(_consume(v1, tl.zeros_like(v1)), 1) + tl.sum(_consume(v2, tl.zeros_like(v2)), 1)
        tl.store(out + rows, y, mask=rows < N)
        if j + 1 < PER:
            v1, v2, rows = n1, n2, nrows
    tl.store(ts + 2 * G + pid, _now())


# B's forms: (name, programs, blocks a program, first block before the wait)
FORMS = [("post", 1024, 1, 0), ("pre", 1024, 1, 1), ("pers512", 512, 2, 1), ("pers256", 256, 4, 1),
         ("pers128", 128, 8, 1)]


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
    ts_a1, ts_a2 = (torch.zeros(3, 16, dtype=torch.int64, device="cuda") for _ in range(2))
    print(f"{props.name}: B = {N} x {KW * 4} bytes ({N * KW * 4 / 1e6:.1f} MB) in blocks of {BN} rows", flush=True)
    us = lambda t: float(t) / 1e3  # noqa: E731
    for spin in (2000, 4000):
        def A(ts=ts_a1, spin=spin):
            _spin_kernel[(16,)](ts, SPIN=spin, PDL=True, launch_pdl=True)
        row = {"A_us": time_graph([A for _ in mats]) * 1e6}
        print(f"spin {spin} ns: A alone {row['A_us']:.2f} us", flush=True)
        for name, progs, per, pre in FORMS:
            ts_b = torch.zeros(3, progs, dtype=torch.int64, device="cuda")
            B = [lambda m=m, progs=progs, per=per, pre=pre, ts_b=ts_b: _stream_kernel[(progs,)](
                m, out, ts_b, N, KW=KW, BN=BN, PER=per, PRE=pre, PDL=True, launch_pdl=True) for m in mats]
            r = {"B_us": time_graph(B) * 1e6}
            r["pair_us"] = time_graph([f for b in B for f in (A, b)]) * 2e6
            r["pair_over_A_us"] = r["pair_us"] - row["A_us"]
            # a timeline from one graph replay of A, B, A (eager launches would add the host's gaps)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                A()
                B[0]()
                A(ts_a2)
            gr.replay()
            torch.cuda.synchronize()
            a1_end, b_end = ts_a1[2].max(), ts_b[2].max()
            r["B_in_med_us"] = us((ts_b[0] - a1_end).median())        # relative to the first A's end
            r["B_go_med_us"] = us((ts_b[1] - a1_end).median())
            r["B_end_us"] = us(b_end - a1_end)
            r["A2_in_med_us"] = us((ts_a2[0] - b_end).median())        # relative to B's end
            r["A2_go_med_us"] = us((ts_a2[1] - b_end).median())
            row[name] = r
            print(f"  B {name:8s} alone {r['B_us']:5.2f} | pair - A {r['pair_over_A_us']:5.2f} us | from A's end: "
                  f"B in {r['B_in_med_us']:6.2f} go {r['B_go_med_us']:5.2f} end {r['B_end_us']:5.2f} | "
                  f"from B's end: next A in {r['A2_in_med_us']:6.2f} go {r['A2_go_med_us']:5.2f}", flush=True)
        res["arms"][f"spin{spin}"] = row
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

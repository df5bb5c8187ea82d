"""How fast can a Triton kernel stream a decode GEMV's weight bytes, by load form?

Session 19's Nsight run says the dp4a GEMV (qgemv_i8) stalls on the L1TEX scoreboard:
too few bytes in flight, because each byte in flight is a register and registers cap
the occupancy (gate_up 36.7%, o 23.5%). Hopper's TMA moves a whole [BN, BK] box into
shared memory on one thread's instruction, so the bytes in flight are the ring's stages,
not registers. This probe streams an int32 matrix the size of a Q4_K weight (N rows of
K / 256 * 144 bytes) and does a Q4_K-like dp4a pair per word, in three forms:

  regs  the current kernels' form: [BN, BK] register loads, the next step's loaded ahead
  tma   a host TensorDescriptor, desc.load in tl.range(num_stages=S) (the compiler's
        mbarrier ring), one row tile a program
  flat  tma, persistent: a grid of SMs x CTAS programs walking (tile, step) as one
        pipelined loop, so the ring never drains between tiles

x words: 'c' a constant (the weight stream alone), 'x' loaded each step (as the GEMV's
int8 activations are). The real qgemv_i8 on the same shape's Q4_K weight is timed beside.
Weight copies cycled to defeat L2; CUDA graphs; no PDL. Prints a table per shape;
$OUT/gpu_stream_probe-*.json.

    GIT_COMMIT=... python bench/gpu_stream_probe.py [--shapes qkv o gate_up down_q4]
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
from gpu_kernels import DECODE_SHAPES, L2_BYTES, copy_bandwidth, decode_weight, run_header, time_graph  # noqa: E402

from alphallama.kernels.gemv.qgemv_i8 import qgemv_i8  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import dp4a, prepare_i8  # noqa: E402


@triton.jit
def _consume(acc, w, xv, DP4A: tl.constexpr):
    """A Q4_K word's pair of dp4a (low and high nibbles) into acc [BN, BK]."""
    acc = dp4a(w & 0x0F0F0F0F, xv, acc, DP4A)
    return dp4a((w >> 4) & 0x0F0F0F0F, xv, acc, DP4A)


@triton.jit
def _x_words(x, k, BK: tl.constexpr, XLOAD: tl.constexpr):
    if XLOAD:
        return tl.load(x + k + tl.arange(0, BK))[None, :]
    return tl.full([1, BK], 0x01010101, tl.int32)


@triton.jit
def _regs_kernel(w, x, out, N, KW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XLOAD: tl.constexpr,
                 DP4A: tl.constexpr = True):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    cols = tl.arange(0, BK)
    ptr = w + rows_c[:, None] * KW + cols[None, :]                     # [BN, BK]
    acc = tl.zeros([BN, BK], tl.int32)
    nxt = tl.load(ptr, mask=cols[None, :] < KW, other=0)
    for k in range(0, KW, BK):
        cur = nxt
        kn = k + BK
        nxt = tl.load(ptr + kn, mask=(kn + cols[None, :]) < KW, other=0)     # a step ahead
        acc = _consume(acc, cur, _x_words(x, k, BK, XLOAD), DP4A)
    tl.store(out + rows, tl.sum(acc, 1), mask=rows < N)


@triton.jit
def _tma_kernel(desc, x, out, N, KW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XLOAD: tl.constexpr,
                STAGES: tl.constexpr, DP4A: tl.constexpr = True):
    r0 = tl.program_id(0) * BN
    acc = tl.zeros([BN, BK], tl.int32)
    for k in tl.range(0, KW, BK, num_stages=STAGES):
        acc = _consume(acc, desc.load([r0, k]), _x_words(x, k, BK, XLOAD), DP4A)
    rows = r0 + tl.arange(0, BN)
    tl.store(out + rows, tl.sum(acc, 1), mask=rows < N)


@triton.jit
def _flat_kernel(desc, x, out, N, per_program: tl.constexpr, KW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 XLOAD: tl.constexpr, STAGES: tl.constexpr, DP4A: tl.constexpr = True):
    NK: tl.constexpr = (KW + BK - 1) // BK
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    acc = tl.zeros([BN, BK], tl.int32)
    # every program walks cdiv(tiles, G) tiles; past the last, the box is out of bounds
    # (TMA fills zeros) and the store is masked
    for i in tl.range(0, per_program * NK, num_stages=STAGES):
        t = pid + (i // NK) * G
        k = (i % NK) * BK
        acc = _consume(acc, desc.load([t * BN, k]), _x_words(x, k, BK, XLOAD), DP4A)
        if i % NK == NK - 1:
            rows = t * BN + tl.arange(0, BN)
            tl.store(out + rows, tl.sum(acc, 1), mask=rows < N)
            acc = tl.zeros([BN, BK], tl.int32)


REGS = [(16, 64, 4), (32, 64, 4), (8, 128, 4), (16, 128, 8)]                          # BN, BK, warps
TMA = [(bn, bk, s, wp) for bn in (16, 32, 64) for bk in (64, 128) for s in (2, 4) for wp in (4,)
       if bn * bk * 4 * s <= 160 << 10] + [(32, 128, 4, 8), (64, 64, 4, 8)]           # BN, BK, stages, warps
FLAT = [(32, 64, 4, 4, 2), (32, 128, 3, 4, 2), (64, 64, 4, 4, 2), (32, 128, 4, 8, 1), (16, 128, 4, 4, 3)]  # + CTAs an SM


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["qkv", "o", "gate_up", "down_q4"])
    ap.add_argument("--xmodes", nargs="*", default=["x"])
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    res = {**run_header(props), "command": " ".join(sys.argv), "copy_Bps": copy_bandwidth(), "rows": []}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_stream_probe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    print(f"copy {res['copy_Bps'] / 1e12:.2f} TB/s (read + write)", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes:
        qt, N, K = DECODE_SHAPES[name]
        w, ws, x8 = decode_weight(name, g)
        x = x8[:1].contiguous()
        prep = prepare_i8(x, w)
        o = torch.empty(1, N, device="cuda")
        row = {"shape": name, "N": N, "K": K, "MB": w.nbytes / 1e6, "us": {}}
        row["us"]["qgemv_i8"] = time_graph([lambda w_=w_: qgemv_i8(x, w_, out=o, prepared=prep) for w_ in ws]) * 1e6
        KW = K // 256 * 144 // 4
        mats = [torch.randint(-2**31, 2**31 - 1, (N, KW), dtype=torch.int32, device="cuda", generator=g)
                for _ in range(max(2, -(-4 * L2_BYTES // (N * KW * 4))))]
        xw = torch.randint(-2**31, 2**31 - 1, (KW + 256,), dtype=torch.int32, device="cuda", generator=g)
        out = torch.empty(N + 64, dtype=torch.int32, device="cuda")
        mb = N * KW * 4 / 1e6
        ref = None

        def timed(key, fns):
            nonlocal ref
            try:
                t = time_graph(fns) * 1e6
                fns[0]()
                if ref is None:
                    ref = out[:N].clone()
                ok = bool(torch.equal(out[:N], ref))
                row["us"][key] = t
                row.setdefault("same", {})[key] = ok
                return f"{key} {t:5.1f}{'' if ok else '!'}"
            except Exception as e:                                  # recorded, not fatal
                row["us"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                torch.cuda.synchronize()
                return f"{key} err"

        for xm in args.xmodes:
            xl = xm == "x"
            ref = None
            cells = []
            for bn, bk, wp in REGS:
                cells.append(timed(f"{xm}:regs{bn}x{bk}w{wp}", [
                    lambda m=m, bn=bn, bk=bk, wp=wp: _regs_kernel[(triton.cdiv(N, bn),)](
                        m, xw, out, N, KW=KW, BN=bn, BK=bk, XLOAD=xl, num_warps=wp) for m in mats]))
            for bn, bk, st, wp in TMA:
                descs = [TensorDescriptor.from_tensor(m, [bn, bk]) for m in mats]
                cells.append(timed(f"{xm}:tma{bn}x{bk}s{st}w{wp}", [
                    lambda d=d, bn=bn, bk=bk, st=st, wp=wp: _tma_kernel[(triton.cdiv(N, bn),)](
                        d, xw, out, N, KW=KW, BN=bn, BK=bk, XLOAD=xl, STAGES=st, num_warps=wp) for d in descs]))
            for bn, bk, st, wp, ctas in FLAT:
                descs = [TensorDescriptor.from_tensor(m, [bn, bk]) for m in mats]
                tiles = triton.cdiv(N, bn)
                grid = (min(tiles, sms * ctas),)
                tiles = triton.cdiv(tiles, grid[0])                 # tiles a program
                cells.append(timed(f"{xm}:flat{bn}x{bk}s{st}w{wp}c{ctas}", [
                    lambda d=d, bn=bn, bk=bk, st=st, wp=wp, grid=grid, tiles=tiles: _flat_kernel[grid](
                        d, xw, out, N, tiles, KW=KW, BN=bn, BK=bk, XLOAD=xl, STAGES=st, num_warps=wp)
                    for d in descs]))
            best = min((v, k) for k, v in row["us"].items() if isinstance(v, float) and k.startswith(xm + ":"))
            print(f"{name} {mb:.1f} MB x={xm} qgemv_i8 {row['us']['qgemv_i8']:5.1f} us | best {best[1]} "
                  f"{best[0]:5.1f} us = {mb / best[0]:.2f} TB/s", flush=True)
            print("   " + " | ".join(cells), flush=True)
        res["rows"].append(row)
        path.write_text(json.dumps(res, indent=1, default=str))
        del ws, mats
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

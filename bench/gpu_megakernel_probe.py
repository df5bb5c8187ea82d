"""Would one persistent kernel a round, streaming the weights through shared memory
across its stage boundaries, beat the PDL chain of kernels?

The round today is ~10 kernels a layer (8B): four GEMVs and six latency-bound kernels
(RoPE, attention split and combine, two norms, SiLU). HBM idles during the small ones and
during every GEMV's ramp and tail (sessions 22-25: ~2.3 us of fixed cost a kernel, whatever
its load form). Session 18's persistent kernel (grid barriers, the next stage's first block
loaded into registers before the spin) did not beat the chain: registers cannot hold what
HBM could fetch during a barrier. Gluon (Triton's explicit dialect, in 3.6) can: cp.async
into a ring of shared-memory slots that stays full across stages, so the weights of the
next GEMV arrive while the CTAs wait at a barrier or run a small stage.

Synthetic layer, 8B-like: GEMV stages qkv / o / gate_up / down of 14.5 / 9.7 / 58 / 29 MB in
16 KB sub-blocks (8 rows of 2 KB), each row summed against a word of the previous GEMV
stage's output (a dependency, read after the barrier); small stages: 16 CTAs spin on
%globaltimer (SPIN ns each: RoPE, split, combine, norm, SiLU, norm), the other CTAs wait.
  chain   one Triton kernel a stage, PDL (GEMV programs load their sub-block before the wait)
  mega    one Gluon kernel: a CTA an SM, a warp a row (no CTA barrier a sub-block), grid
          barrier (release add, acquire spin) between stages, the CTA's sub-blocks of every GEMV of every layer one flat stream through
          NS slots of shared memory (NS - 1 copies in flight, issued as slots free)
Both make the same sums (checked against torch). us a layer, against the bytes at the copy
rate. $OUT/gpu_megakernel_probe-*.json.
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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_kernels import copy_bandwidth, run_header, time_graph  # noqa: E402
from gpu_pdl_overlap import _now  # noqa: E402

from alphallama.kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import dp4a  # noqa: E402

SUB = 4096                              # int32 words a sub-block (16 KB: R = 8 rows of 2 KB)
R = 8
GEMV_MB = (14.5, 9.7, 58.0, 29.0)       # qkv, o, gate_up, down
SMALL = ("rope", "split", "combine", "norm")   # before o; then "norm" after o, "silu" before down, "norm" after


# -- the chain --------------------------------------------------------------------------
@triton.jit
def _spin_k(SPIN: tl.constexpr, PDL: tl.constexpr):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t0 = _now()
    t = t0
    while t - t0 < SPIN:
        t = _now()


@triton.jit
def _gemv_k(w, out, xsrc, SUB: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr, DP4A: tl.constexpr = False,
            PRE: tl.constexpr = True):
    """Program b: sub-block b of w (R rows, loaded before the wait unless not PRE) against
    the word at xsrc, or (DP4A) against the 2 x 512 words from xsrc as a Q4_K row's codes
    against int8 activations: two dp4a a weight word, the activations loaded after the wait."""
    b = tl.program_id(0)
    pdl_trigger(PDL)
    KW: tl.constexpr = SUB // R
    offs = tl.arange(0, R)[:, None] * KW + tl.arange(0, KW)[None, :]
    if PRE:
        v = tl.load(w + b.to(tl.int64) * SUB + offs)                        # [R, KW]
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        v = tl.load(w + b.to(tl.int64) * SUB + offs)
    if DP4A:
        xa = tl.load(xsrc + tl.arange(0, KW), cache_modifier=".cg")          # [KW]
        xb = tl.load(xsrc + KW + tl.arange(0, KW), cache_modifier=".cg")
        t = dp4a(v & 0x0F0F0F0F, xa[None, :], tl.zeros_like(v), True)
        t = dp4a((v >> 4) & 0x0F0F0F0F, xb[None, :], t, True)
    else:
        xw = tl.load(xsrc, cache_modifier=".cg") & 7
        t = (v & 0xFF) + ((v >> 8) & 0xFF) * xw
    tl.store(out + b * R + tl.arange(0, R), tl.sum(t, 1))


# -- the persistent kernel ---------------------------------------------------------------
@gluon.jit
def _g_now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _g_barrier(cnt, target):
    """This CTA's stores, then its one release arrival; spin until `target` arrivals."""
    gl.thread_barrier()
    gl.atomic_add(cnt, 1, sem="release", scope="gpu")
    seen = gl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = gl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _g_small(cnt, t, c, SPIN: gl.constexpr, P: gl.constexpr):
    """A latency-bound stage: 16 CTAs spin, then everyone passes stage t's barrier."""
    if c < 16:
        t0 = _g_now()
        tt = t0
        while tt - t0 < SPIN:
            tt = _g_now()
    _g_barrier(cnt, (t + 1) * P)
    return t + 1


@gluon.jit
def _g_issue(w, ring, f, total, per_layer, n0, n1, n2, c, NB0: gl.constexpr, NB1: gl.constexpr,
             NB2: gl.constexpr, NBL: gl.constexpr, P: gl.constexpr, NS: gl.constexpr, SUB: gl.constexpr,
             R: gl.constexpr, layout: gl.constexpr):
    """Copy the CTA's flat sub-block f (past the end: nothing) into slot f % NS; one group."""
    layer = f // per_layer
    r = f % per_layer
    g1 = (r >= n0).to(gl.int32)
    g2 = (r >= n0 + n1).to(gl.int32)
    g3 = (r >= n0 + n1 + n2).to(gl.int32)
    base = NB0 * g1 + NB1 * g2 + NB2 * g3
    k = r - (n0 * g1 + n1 * g2 + n2 * g3)
    blk = (layer * NBL + base + c + k * P).to(gl.int64)
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, SUB // R, layout=gl.SliceLayout(0, layout))
    offs = rows[:, None] * (SUB // R) + cols[None, :]                   # [R, SUB / R]
    ok = (offs * 0 + f) < total
    async_copy.async_copy_global_to_shared(ring.index(f % NS), w + blk * SUB + offs, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _mega_k(w, out, cnt, L, NB0: gl.constexpr, NB1: gl.constexpr, NB2: gl.constexpr, NB3: gl.constexpr,
            SP_ROPE: gl.constexpr, SP_SPLIT: gl.constexpr, SP_COMB: gl.constexpr, SP_NORM: gl.constexpr,
            SP_SILU: gl.constexpr, P: gl.constexpr, NS: gl.constexpr, SUB: gl.constexpr, WARPS: gl.constexpr):
    # a warp a row of the sub-block: every thread reads back only what it copied (no CTA
    # barrier a sub-block) and a row's sum is a warp's shuffles
    R: gl.constexpr = WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
    smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.int32, [NS, R, SUB // R], smem_layout)
    NBL: gl.constexpr = NB0 + NB1 + NB2 + NB3
    c = gl.program_id(0)
    n0 = (NB0 - c + P - 1) // P
    n1 = (NB1 - c + P - 1) // P
    n2 = (NB2 - c + P - 1) // P
    n3 = (NB3 - c + P - 1) // P
    per_layer = n0 + n1 + n2 + n3
    total = L * per_layer
    for i in gl.static_range(NS - 1):
        _g_issue(w, ring, i, total, per_layer, n0, n1, n2, c, NB0, NB1, NB2, NBL, P, NS, SUB, R, layout)
    f = c * 0          # the flat index of the next sub-block to consume
    t = c * 0          # stages passed (barrier targets)
    xsrc = out + (NB0 + NB1 + NB2) * R   # the down's row 0 (the first layer's: zero-filled)
    for layer in range(L):
        for g in gl.static_range(4):
            if g == 0:
                n, obase = n0, 0
            elif g == 1:
                n, obase = n1, NB0
            elif g == 2:
                n, obase = n2, NB0 + NB1
            else:
                n, obase = n3, NB0 + NB1 + NB2
            xw = gl.load(xsrc, cache_modifier=".cg") & 7
            for k in range(n):
                _g_issue(w, ring, f + NS - 1, total, per_layer, n0, n1, n2, c, NB0, NB1, NB2, NBL, P, NS,
                         SUB, R, layout)
                async_copy.wait_group(NS - 1)           # sub-block f has landed (this thread's part)
                v = ring.index(f % NS).load(layout)     # [R, SUB / R]
                tt = (v & 0xFF) + ((v >> 8) & 0xFF) * xw
                ys = gl.sum(tt, 1)                      # [R] (a warp's shuffles)
                gl.store(out + (obase + c + k * P) * R + gl.arange(0, R, layout=gl.SliceLayout(1, layout)), ys)
                f += 1
            _g_barrier(cnt, (t + 1) * P)
            t += 1
            xsrc = out + obase * R
            if g == 0:
                t = _g_small(cnt, t, c, SP_ROPE, P)
                t = _g_small(cnt, t, c, SP_SPLIT, P)
                t = _g_small(cnt, t, c, SP_COMB, P)
            elif g == 1:
                t = _g_small(cnt, t, c, SP_NORM, P)
            elif g == 2:
                t = _g_small(cnt, t, c, SP_SILU, P)
            else:
                t = _g_small(cnt, t, c, SP_NORM, P)
    async_copy.wait_group(0)


def reference(w: torch.Tensor, nbs: list[int], L: int) -> torch.Tensor:
    """The last layer's row sums, as both forms make them (int64, then wrapped to int32)."""
    offs = [0, nbs[0], nbs[0] + nbs[1], nbs[0] + nbs[1] + nbs[2]]
    nbl = sum(nbs)
    out = torch.zeros(nbl * R, dtype=torch.int64, device=w.device)
    for layer in range(L):
        for g in range(4):
            xsrc = offs[3] if g == 0 else offs[g - 1]
            xw = int(out[xsrc * R].to(torch.int32).item()) & 7
            blocks = w[(layer * nbl + offs[g]) * SUB:(layer * nbl + offs[g] + nbs[g]) * SUB].view(nbs[g] * R, -1).long()
            s = ((blocks & 0xFF) + ((blocks >> 8) & 0xFF) * xw).sum(1)
            out[offs[g] * R:(offs[g] + nbs[g]) * R] = ((s + 2**31) % 2**32) - 2**31
    return out.to(torch.int32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ns", type=int, nargs="*", default=[8])
    ap.add_argument("--spin-scale", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    P = props.multi_processor_count
    L = args.layers
    nbs = [int(mb * (1 << 20) / (SUB * 4)) for mb in GEMV_MB]
    nbl = sum(nbs)
    bw = copy_bandwidth()
    floor_us = nbl * SUB * 4 / bw * 1e6
    res = {**run_header(props), "command": " ".join(sys.argv), "commit": os.environ.get("GIT_COMMIT"),
           "layers": L, "sub_blocks": nbs, "copy_GBps": bw / 1e9, "bytes_floor_us_per_layer": floor_us, "rows": []}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_megakernel_probe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (L * nbl * SUB,), dtype=torch.int32, device="cuda", generator=g)
    offs = [0, nbs[0], nbs[0] + nbs[1], nbs[0] + nbs[1] + nbs[2]]
    ref = reference(w, nbs, L)
    out = torch.zeros(nbl * R, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{props.name}: {P} SMs, {L} layers of {nbl * SUB * 4 / 1e6:.0f} MB, floor {floor_us:.1f} us a layer "
          f"at {bw / 1e9:.0f} GB/s", flush=True)

    def timed(fn) -> float:
        """us a layer: the median replay of a CUDA graph of one call."""
        return time_graph([fn], args.reps) * 1e6 / L

    for scale in args.spin_scale:
        sp = {k: int(v * scale) for k, v in dict(rope=500, split=1500, comb=800, norm=800, silu=500).items()}
        row = {"spin_ns": sp, "us_per_layer": {}, "equal": {}}

        def chain(dp4a=False, pre=True):
            out.zero_()
            for layer in range(L):
                for gi in range(4):
                    xsrc = out[offs[3] * R:] if gi == 0 else out[offs[gi - 1] * R:]
                    wl = w[(layer * nbl + offs[gi]) * SUB:]
                    _gemv_k[(nbs[gi],)](wl, out[offs[gi] * R:], xsrc, SUB=SUB, R=R, PDL=True, launch_pdl=True,
                                        DP4A=dp4a, PRE=pre, num_warps=4)
                    for name in {0: ("rope", "split", "comb"), 1: ("norm",), 2: ("silu",), 3: ("norm",)}[gi]:
                        _spin_k[(16,)](SPIN=sp[name], PDL=True, launch_pdl=True, num_warps=1)
        row["us_per_layer"]["chain"] = timed(chain)
        row["equal"]["chain"] = bool(torch.equal(out, ref))
        # the same chain with a Q4_K row's dp4a work (no reference: timing only), weights
        # loaded before and after the wait
        row["us_per_layer"]["chain_dp4a"] = timed(lambda: chain(True))
        row["us_per_layer"]["chain_dp4a_post"] = timed(lambda: chain(True, False))
        row["equal"]["chain_dp4a"] = row["equal"]["chain_dp4a_post"] = None
        for ns in args.ns:
            def mega(ns=ns):
                out.zero_()
                cnt.zero_()
                _mega_k[(P,)](w, out, cnt, L, NB0=nbs[0], NB1=nbs[1], NB2=nbs[2], NB3=nbs[3], SP_ROPE=sp["rope"],
                              SP_SPLIT=sp["split"], SP_COMB=sp["comb"], SP_NORM=sp["norm"], SP_SILU=sp["silu"],
                              P=P, NS=ns, SUB=SUB, WARPS=8, num_warps=8)
            row["us_per_layer"][f"mega_ns{ns}"] = timed(mega)
            row["equal"][f"mega_ns{ns}"] = bool(torch.equal(out, ref))
        res["rows"].append(row)
        ok = {True: "ok", False: "WRONG", None: "-"}
        print(f"spins x{scale}: " + "  ".join(f"{k} {v:6.2f} us/layer ({ok[row['equal'][k]]})"
                                              for k, v in row["us_per_layer"].items()), flush=True)
        path.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

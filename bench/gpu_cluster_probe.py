"""Can a thread-block cluster take a small kernel's work into the GEMV before it?

Every fusion tried so far that gave a kernel's per-row work to its producer lost: the work
needs values from several programs (a head's 128 rows for the q/k norm and RoPE, a 32-block
for the int8 scale), and the forms that reached them (bigger tiles, a last-arriving program
behind a gpu-scope atomic) cost more than the launch they saved. Hopper has a third form:
the CTAs of a cluster (up to 8, co-scheduled on one GPC) share a hardware barrier
(barrier.cluster.arrive.release / wait.acquire). Triton compiles num_ctas > 1 only with its
own multi-CTA layouts (its PlanCTA pass fails on a plain GEMV), but a kernel compiled for one
CTA can be launched in clusters: the launcher takes the cluster size from the compiled
kernel's packed metadata, so `launch_clustered` sets it there (kernels/cluster.py's job if
this wins); the barrier is inline PTX.

Chain per cycle in a PDL graph (weights cycled past L2): A (16 programs spinning ~2 us, a norm's
latency) -> B (a GEMV-like stream: BN whole rows a program, dp4a over the words) and then:
  two      C: a kernel of N / G programs, each reads G of B's outputs, sums their squares and
           writes them scaled (the q/k norm's shape of work)
  clK      B launched in clusters of K (no barrier), then C: what clustering itself costs
  fusedK   B in clusters of K = G / BN: each program stores its rows, the cluster barrier,
           loads the group's G outputs past L1 and writes its own rows scaled: no C
Shapes: qkv-like (6144 rows x 2304 bytes, 16 rows a program, 8 warps, groups of 128) and
o-like (4096 rows, 4 rows a program, 4 warps, groups of 32). The fused form's output is
checked against the two-kernel form's after B's outputs were set to NaN (a program reading
before its cluster's stores would carry a NaN). $OUT/gpu_cluster_probe-*.json.
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
from gpu_pdl_overlap import _consume, _spin_kernel  # noqa: E402

from alphallama.kernels.pdl import pdl_trigger, pdl_wait  # noqa: E402


@triton.jit
def _cluster_sync(dep):
    """Every thread of every CTA of the cluster: arrive (release) and wait (acquire). dep: a
    value the caller's earlier stores made (orders the asm after them); returns 0, to be added
    to the addresses loaded after (orders those loads after the barrier)."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _b_kernel(w, out, out2, N, eps, KW: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, CL: tl.constexpr,
              FUSE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)                                   # [BN]
    ptr = w + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * KW
    pdl_trigger(PDL)
    v1 = tl.load(ptr + tl.arange(0, 512)[None, :])                       # [BN, 512]
    v2 = tl.load(ptr + 512 + tl.arange(0, 64)[None, :])                  # [BN, 64]
    pdl_wait(PDL)
    y = (tl.sum(_consume(v1, tl.zeros_like(v1)), 1) + tl.sum(_consume(v2, tl.zeros_like(v2)), 1)).to(tl.float32)
    y = y * 1e-6                                                         # [BN] (keeps squares finite)
    tl.store(out + rows, y, mask=rows < N)
    if FUSE:
        z = _cluster_sync(tl.sum(y, 0).to(tl.int32))                      # scalar 0
        g0 = (pid * BN) // G * G
        v = tl.load(out + g0 + z + tl.arange(0, G), cache_modifier=".cg")  # [G]
        r = tl.rsqrt(tl.sum(v * v, 0) / G + eps)
        tl.store(out2 + rows, y * r, mask=rows < N)


@triton.jit
def _c_kernel(out, out2, eps, G: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    pdl_trigger(PDL)
    pdl_wait(PDL)
    offs = pid * G + tl.arange(0, G)
    v = tl.load(out + offs)
    r = tl.rsqrt(tl.sum(v * v, 0) / G + eps)
    tl.store(out2 + offs, v * r)


def launch_clustered(fn, n_programs: int, cluster: int, *args, **kwargs) -> None:
    """fn's programs 0..n_programs-1 in clusters of `cluster` consecutive ones (a kernel
    compiled for one CTA; its own key must differ by cluster size, e.g. a constexpr)."""
    assert n_programs % cluster == 0
    grid = (n_programs // cluster,)                 # the launcher multiplies x by the cluster size
    ck = fn.warmup(*args, grid=grid, **kwargs)
    nw, nc, shared = ck.packed_metadata
    assert getattr(ck.metadata, "global_scratch_size", 0) == 0
    if nc != cluster:
        ck.packed_metadata = (nw, cluster, shared)
    fn[grid](*args, **kwargs)


SHAPES = {"qkv": dict(N=6144, BN=16, warps=8, G=128), "o": dict(N=4096, BN=4, warps=4, G=32)}


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "shapes": {}}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_cluster_probe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    KW, eps = 576, 1e-6
    g = torch.Generator(device="cuda").manual_seed(0)
    ts = torch.zeros(3, 16, dtype=torch.int64, device="cuda")

    def A():
        _spin_kernel[(16,)](ts, SPIN=2000, PDL=True, launch_pdl=True)
    a_us = time_graph([A] * 16) * 1e6
    res["A_us"] = a_us
    print(f"{props.name}: A alone {a_us:.2f} us", flush=True)
    for sname, s in SHAPES.items():
        N, BN, nw, G = s["N"], s["BN"], s["warps"], s["G"]
        n_copies = max(8, -(-4 * L2_BYTES // (N * KW * 4)))
        mats = [torch.randint(-2**31, 2**31 - 1, (N, KW), dtype=torch.int32, device="cuda", generator=g)
                for _ in range(n_copies)]
        out = torch.empty(N, dtype=torch.float32, device="cuda")
        out2 = torch.empty(N, dtype=torch.float32, device="cuda")
        P, K = N // BN, G // BN

        def B(m, cl=1, fuse=False):
            kw = dict(KW=KW, BN=BN, G=G, CL=cl, FUSE=fuse, PDL=True, launch_pdl=True, num_warps=nw)
            if cl == 1:
                _b_kernel[(P,)](m, out, out2, N, eps, **kw)
            else:
                launch_clustered(_b_kernel, P, cl, m, out, out2, N, eps, **kw)

        def C():
            _c_kernel[(N // G,)](out, out2, eps, G=G, PDL=True, launch_pdl=True, num_warps=1 if G <= 32 else 4)

        arms = {"two": lambda m: (B(m), C())}
        for cl in sorted({2, 4, K}):
            arms[f"cl{cl}"] = lambda m, cl=cl: (B(m, cl), C())
        arms[f"fused{K}"] = lambda m: B(m, K, True)
        # correctness of the fused form: B's outputs poisoned first
        out.fill_(float("nan"))
        arms["two"](mats[0])
        ref = out2.clone()
        out.fill_(float("nan"))
        out2.zero_()
        arms[f"fused{K}"](mats[0])
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out2).all()) and torch.allclose(out2, ref, rtol=1e-5, atol=0)
        row = {"fused_matches": ok, "fused_max_rel": float(((out2 - ref).abs() / ref.abs().clamp_min(1e-30)).max())}
        for name, f in arms.items():
            cyc = time_graph([lambda m=m: (A(), f(m)) for m in mats]) * 1e6
            row[name] = {"cycle_us": cyc, "over_A_us": cyc - a_us}
        res["shapes"][sname] = {**s, "K": K, **row}
        print(f"{sname}: N {N} BN {BN} warps {nw} groups {G} (fused ok: {ok}, max rel {row['fused_max_rel']:.1e})")
        for name in arms:
            print(f"  {name:8s} cycle {row[name]['cycle_us']:6.2f} us, less A {row[name]['over_A_us']:6.2f}", flush=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Can a latency-bound kernel move the next GEMV's weights into L2 if the prefetches are
spread over every SM?

Three earlier tries lost (docs/decisions/lost-experiments.md), each for a reason of its form:
bulk prefetches issued by the few programs of a norm (one SM's copy engine served them at
~0.35 TB/s and the chain waited), a side-stream kernel of real loads (it held SM slots and
its fork broke the PDL edge), per-line prefetches in every GEMV program (instructions on
each program's critical path). Untried: extra programs in the small kernel's own grid,
each issuing a few prefetches for a slice of the next weight and exiting at once, so that
every SM's copy engine works in parallel, nothing is forked and no slot is held.

A = 16 programs spinning SPIN ns (a norm, a RoPE, an attention combine) plus PF programs
that prefetch FRAC of B's bytes and exit; B = the o-sized or down-sized stream of
gpu_pdl_overlap (`pre`: loads before the PDL wait). A PDL graph of (A, B) pairs over
copies cycled past L2. Modes: bulk (cp.async.bulk.prefetch.L2, one CH-byte chunk a
thread), line (prefetch.global.L2, one 128-byte line a thread a step). Reported: the pair
less A alone (B's cost in the chain) and A with its prefetch programs alone (does A
wait for them). $OUT/gpu_l2_spread_probe-*.json.
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
from gpu_pdl_overlap import _spin, _stream_kernel  # noqa: E402



@triton.jit
def _bulk_prefetch(addr, size):
    return tl.inline_asm_elementwise("{\ncp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
                                     "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(addr):
    return tl.inline_asm_elementwise("{\nprefetch.global.L2 [$1];\nmov.u32 $0, 0;\n}",
                                     "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_pf_kernel(ts, base, pf_bytes, SPIN: tl.constexpr, A_PROGS: tl.constexpr, MODE: tl.constexpr,
                    CH: tl.constexpr, NT: tl.constexpr, PDL: tl.constexpr):
    """Programs < A_PROGS: A (ts [3, A_PROGS] as gpu_pdl_overlap's spin). The rest: thread t of
    prefetch program j takes chunks (j + i * PF) * NT + t of [base, base + pf_bytes), where a
    chunk is CH bytes (MODE 1, one bulk prefetch) or a 128-byte line (MODE 2)."""
    pid = tl.program_id(0)
    if pid >= A_PROGS:
        j = pid - A_PROGS
        PF = tl.num_programs(0) - A_PROGS
        size = CH if MODE == 1 else 128
        n = pf_bytes // size
        t = tl.arange(0, NT)
        for c0 in range(j * NT, n, PF * NT):
            c = tl.minimum(c0 + t, n - 1).to(tl.int64)            # [NT]; past the end: the last again
            if MODE == 1:
                _bulk_prefetch(base + c * size, tl.full([NT], CH, tl.int32))
            else:
                _line_prefetch(base + c * size)
    else:
        _spin(ts, pid, A_PROGS, SPIN, PDL)


# (name, mode, fraction of B prefetched, chunk bytes, prefetch programs)
CONFIGS = [("none", 0, 0.0, 0, 0), ("bulk16k", 1, 1.0, 16384, 132), ("bulk64k", 1, 1.0, 65536, 132),
           ("bulk16k-half", 1, 0.5, 16384, 132), ("bulk4k-528", 1, 1.0, 4096, 528),
           ("line", 2, 1.0, 128, 132), ("line-half", 2, 0.5, 128, 132)]


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    res = {**run_header(props), "command": " ".join(sys.argv), "arms": {}}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_l2_spread_probe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    KW, BN, NT, A_PROGS = 576, 4, 128, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    ts_a = torch.zeros(3, A_PROGS, dtype=torch.int64, device="cuda")
    for N in (4096, 12288):                                           # o (9.4 MB), a down (28 MB)
        mb = N * KW * 4 / 1e6
        n_copies = max(6, -(-3 * L2_BYTES // (N * KW * 4)))
        mats = [torch.randint(-2**31, 2**31 - 1, (N, KW), dtype=torch.int32, device="cuda", generator=g)
                for _ in range(n_copies)]
        out = torch.empty(N, dtype=torch.int32, device="cuda")
        ts_b = torch.zeros(3, N // BN, dtype=torch.int64, device="cuda")
        B = [lambda m=m: _stream_kernel[(N // BN,)](m, out, ts_b, N, KW=KW, BN=BN, PER=1, PRE=1, PDL=True,
                                                    launch_pdl=True) for m in mats]
        b_alone = time_graph(B) * 1e6
        for spin in (2000, 4000):
            row = {"B_us": b_alone, "MB": mb}
            for name, mode, frac, ch, pf in CONFIGS:
                nbytes = int(N * KW * 4 * frac) // max(ch, 128) * max(ch, 128)

                def A(m, mode=mode, ch=ch, pf=pf, nbytes=nbytes):
                    _spin_pf_kernel[(A_PROGS + pf,)](ts_a, m.data_ptr(), nbytes, SPIN=spin, A_PROGS=A_PROGS,
                                                     MODE=mode, CH=max(ch, 128), NT=NT, PDL=True,
                                                     launch_pdl=True)
                a_alone = time_graph([lambda m=m: A(m) for m in mats]) * 1e6
                pair = time_graph([f for m, b in zip(mats, B) for f in (lambda m=m: A(m), b)]) * 2e6
                a_plain = row.get("none", {}).get("A_us", a_alone)
                r = {"A_us": a_alone, "pair_us": pair, "pair_over_A_us": pair - a_plain, "bytes": nbytes}
                row[name] = r
                print(f"N {N} ({mb:.1f} MB) spin {spin}: {name:13s} A {a_alone:5.2f} | pair {pair:6.2f} | "
                      f"pair - plain A {pair - a_plain:5.2f} us (B alone {b_alone:5.2f})", flush=True)
            res["arms"][f"N{N}-spin{spin}"] = row
        del mats
        torch.cuda.empty_cache()
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

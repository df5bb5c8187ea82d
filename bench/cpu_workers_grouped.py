"""The CPU expert workers on one MoE layer's missed pairs: per pair (the library as it was
before grouping, built from git) against grouped by expert (this tree's), in the same run.

    PYTHONPATH=src python bench/cpu_workers_grouped.py [--threads N --posts 40 --reps 4]
        [--widths 1 4 8] [--baseline 86cdd37] [--out bench/results]

One Qwen3-30B-A3B MoE layer (D 2048, F 768, gate|up Q4_K, down Q6_K, 128 experts of 3.1 MB:
400 MB, far past any L3) on random planes. Each post is a round of W rows, every pair the
CPU's (a miss), its experts drawn afresh (so they stream from RAM): "shared", all W rows
route to the same k experts (a verify round of a repeated token: k distinct experts, W k
pairs); "distinct", the rows route to W k different experts (W = 1: the two are one case).

Each library runs in its own child process (two libraries in one process timed a few %
apart by which was loaded first), `reps` children each, alternating which goes first; a
child starts a pool, times every case's posts (from REQ to DONE, polled on a cpu the
workers do not use) and reports the times and a hash of each case's last outputs, which
must be equal between the libraries (bit for bit). Per case and library: the median of
the children's median posts (robust to a burst from the VM's neighbours spoiling one
child), each child's, the p10 and p90 of all posts; GB/s, the distinct experts' bytes over
the median (what RAM delivered) and the pairs' (W k experts' bytes); the speedup, the
median over reps of the ratio of a rep's two children (adjacent in time: a shared VM's
neighbours slow both alike).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.bench.hostinfo import host_state
from alphallama.offload.mailbox import DONE, LAYER, REQ, ROWS, Mailbox
from alphallama.offload.native import build
from alphallama.offload.native.bench import build_at, random_weight
from alphallama.offload.native.kernels import LayerDesc, qmat

BASELINE = "86cdd37"     # main before the grouped workers: one task per (row, rank) pair
D, F, K_TOP = 2048, 768, 8


def load(so: str) -> ctypes.CDLL:
    """A library by path, or this tree's ("tree": build.lib's verified build)."""
    lib = build.lib() if so == "tree" else ctypes.CDLL(so)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.aq_pool_start.restype, lib.aq_pool_start.argtypes = P, [I, P, P, P, P, P, P, P, P, I, I, I, P, I]
    lib.aq_pool_stop.restype, lib.aq_pool_stop.argtypes = None, [P]
    return lib


def cases(widths: list[int], posts: int, E: int) -> list[tuple[str, list[torch.Tensor]]]:
    """(name, [posts] routings [W, k]): the same for every child (a seeded generator)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for W in widths:
        for routing in ["shared"] if W == 1 or W * K_TOP > E else ["shared", "distinct"]:
            ids = []
            for _ in range(posts):
                pick = torch.randperm(E, generator=g)[: K_TOP if routing == "shared" else W * K_TOP].to(torch.int32)
                ids.append(pick.repeat(W, 1) if routing == "shared" else pick.reshape(W, K_TOP))
            out.append((f"{W}/{routing}", ids))
    return out


def child(so: str, widths: list[int], posts: int, E: int, cpus: list[int], nap: float) -> dict:
    """Time every case's posts through one pool of `so`: {case: {"times": [s], "y": sha256}}."""
    lib = load(so)
    gu, dn = random_weight(T.Q4_K, (E, 2 * F, D), 1), random_weight(T.Q6_K, (E, D, F), 2)
    descs = (LayerDesc * 1)(LayerDesc(qmat(gu), qmat(dn)))
    W_max = max(widths)
    mb = Mailbox.new(W_max, D, K_TOP)
    x = torch.randn(W_max, D, generator=torch.Generator().manual_seed(1))
    xq = (x * 40).round().clamp(-127, 127).to(torch.int8)
    mb.xq.copy_(xq)
    mb.dx.copy_(x.abs().reshape(W_max, -1, 32).amax(-1) / 127)
    mb.xs.copy_(xq.to(torch.int32).reshape(W_max, -1, 16).sum(-1))
    mb.task.fill_(1)
    arr = (ctypes.c_int * len(cpus))(*cpus)
    h = lib.aq_pool_start(len(cpus), arr, mb.ctl.data_ptr(), mb.xq.data_ptr(), mb.dx.data_ptr(), mb.xs.data_ptr(),
                          mb.ids.data_ptr(), mb.task.data_ptr(), mb.y.data_ptr(), W_max, K_TOP, D,
                          ctypes.byref(descs), 1)
    assert h, f"the pool did not start on cpus {cpus}"
    out, req = {}, 0
    try:
        for name, ids in cases(widths, posts, E):
            times = []
            for r in ids:
                W = r.shape[0]
                mb.ids[:W] = r
                mb.ctl[LAYER], mb.ctl[ROWS] = 0, W
                req += 1
                t0 = time.perf_counter()
                mb.ctl[REQ] = req
                while int(mb.ctl[DONE]) != req:
                    if nap:
                        time.sleep(nap)
                times.append(time.perf_counter() - t0)
            y = mb.y[:ids[-1].shape[0]].contiguous().numpy().tobytes()
            out[name] = {"times": times[max(1, len(times) // 10):],      # the first posts wake the threads
                         "y": hashlib.sha256(y).hexdigest()}
    finally:
        lib.aq_pool_stop(h)
    return out


def vnni() -> bool:
    """Whether the cpu has the VNNI byte dots the slot sums use."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in info or "avx_vnni" in info


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def stats(children: list[list[float]], distinct_b: float, pair_b: float) -> dict:
    """A case's figures over its children's posts: median_us is the median of the children's
    medians (a burst from the VM's neighbours spoils a child, not the figure), p10 / p90 of
    all the posts; GB/s at median_us."""
    t = sorted(x for c in children for x in c)
    med = _median([_median(c) for c in children])
    return {"median_us": round(med * 1e6, 1), "p10_us": round(t[len(t) // 10] * 1e6, 1),
            "p90_us": round(t[len(t) * 9 // 10] * 1e6, 1),
            "child_medians_us": [round(_median(c) * 1e6, 1) for c in children],
            "ram_gb_s": round(distinct_b / med / 1e9, 2), "pair_gb_s": round(pair_b / med / 1e9, 2)}


def placement(threads: int | None) -> tuple[int, list[int], float]:
    """(this thread's cpu, the workers' cpus, the poll's nap: 0 with a cpu of its own)."""
    me = sorted(os.sched_getaffinity(0))
    cpus = (me[1:] + me[:1])[: threads or max(len(me) - 1, 1)]   # this thread's cpu last, only if asked for
    return me[0], cpus, 0.0 if me[0] not in cpus else 2e-5


def run_child(so: str, a) -> dict:
    cmd = [sys.executable, __file__, "--child", so, "--posts", str(a.posts), "--experts", str(a.experts),
           "--widths", *map(str, a.widths), *(["--threads", str(a.threads)] if a.threads else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def summarize(runs: dict[str, list[dict]], expert_b: float) -> list[dict]:
    rows = []
    for name in runs["per_pair"][0]:
        W, routing = int(name.split("/")[0]), name.split("/")[1]
        n_distinct = K_TOP if routing == "shared" else W * K_TOP
        hashes = {r[name]["y"] for lib in runs.values() for r in lib}
        row = {"W": W, "routing": routing, "pairs": W * K_TOP, "distinct_experts": n_distinct,
               "bit_exact": len(hashes) == 1}
        for lib, rs in runs.items():
            row[lib] = stats([r[name]["times"] for r in rs], n_distinct * expert_b, W * K_TOP * expert_b)
        # each rep's two children ran one after the other: their ratio sees the same neighbours
        pairs = [pp / g for pp, g in zip(row["per_pair"]["child_medians_us"], row["grouped"]["child_medians_us"])]
        row["speedup_by_rep"] = [round(r, 3) for r in pairs]
        row["speedup"] = round(_median(pairs), 2)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None, help="workers (default: every cpu but this thread's)")
    ap.add_argument("--posts", type=int, default=40)
    ap.add_argument("--reps", type=int, default=4, help="children per library")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--baseline", default=BASELINE)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    mine, cpus, nap = placement(a.threads)
    if a.child:
        os.sched_setaffinity(0, {mine})                # this thread polls on its own cpu
        print(json.dumps(child(a.child, a.widths, a.posts, a.experts, cpus, nap)))
        return
    runs: dict[str, list[dict]] = {"per_pair": [], "grouped": []}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"per_pair": str(build_at(a.baseline, Path(tmp))), "grouped": "tree"}
        build.lib()                                    # built once, before the children load it
        for rep in range(a.reps):                      # alternate which goes first: drift hits both alike
            for name in (["per_pair", "grouped"] if rep % 2 == 0 else ["grouped", "per_pair"]):
                runs[name].append(run_child(libs[name], a))
    expert_b = (random_weight(T.Q4_K, (1, 2 * F, D), 1).nbytes + random_weight(T.Q6_K, (1, D, F), 2).nbytes)
    results = summarize(runs, expert_b)
    for row in results:
        print(json.dumps(row), flush=True)
    host = host_state(sys.argv)      # the device copy is no git checkout: GIT_COMMIT names it there
    out = {**host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"], "vnni": vnni(),
           "note": (f"{len(cpus)} worker thread(s) on a {os.cpu_count()}-core shared VM, the poll on "
                    f"{'its own cpu' if not nap else 'a worker cpu, with 20 us naps'}: not the device host's "
                    "15 workers; the ratios, not the absolute rates, are the finding"),
           "baseline": a.baseline, "threads": len(cpus),
           "shape": {"D": D, "F": F, "experts": a.experts, "top_k": K_TOP, "formats": ["Q4_K", "Q6_K"],
                     "expert_mb": round(expert_b / 1e6, 3)},
           "posts": a.posts, "reps": a.reps, "loadavg": os.getloadavg(), "results": results}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"cpu_workers_grouped-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(path)


if __name__ == "__main__":
    main()

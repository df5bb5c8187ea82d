"""Timing of the CPU expert workers on synthetic planes (for bench JSON; not a test).

    python -m alphallama.offload.native.bench [--threads N] [--experts E] [--tasks T]

Planes are random bits with finite scale fields (the arithmetic's cost does not depend
on the values); the default shape is one Qwen3-30B-A3B MoE layer (D 2048, F 768,
gate|up Q4_K, down Q6_K). Each post asks for `tasks` different experts of one row,
chosen at random among `experts`, so with many experts the weights stream from RAM.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

from ...kernels.formats.format import PLANES
from ...kernels.formats.qweight import FORMATS, QuantWeight
from ..mailbox import DONE, LAYER, REQ, ROWS, Mailbox
from . import build
from .probe import probe
from .workers import CpuExperts


NATIVE = "src/alphallama/offload/native"


def build_at(ref: str, tmp: Path) -> Path:
    """The native library as it was at git ref (its .c files), built with today's flags into
    tmp (a baseline arm); ref may be a folder holding those .c files instead (a machine
    without the repo's git, e.g. the device: `git archive 86cdd37 src/alphallama/offload/native
    | tar -x -C .devcarry/old`, then --baseline .devcarry/old/src/alphallama/offload/native)."""
    if Path(ref).is_dir():
        for c in Path(ref).glob("*.c"):
            (tmp / c.name).write_bytes(c.read_bytes())
        ref = Path(ref).name
    else:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:{NATIVE}"], capture_output=True, text=True,
                               check=True).stdout.split()
        for n in (n for n in names if n.endswith(".c")):
            src = subprocess.run(["git", "show", f"{ref}:{NATIVE}/{n}"], capture_output=True, check=True).stdout
            (tmp / n).write_bytes(src)
    so = tmp / f"experts-{ref}.so"
    cmd = [build.find_compiler(), *build.FLAGS, f"-march={build.MARCH}", "-o", str(so), str(tmp / "pool.c"), "-lm"]
    subprocess.run(cmd, check=True)
    return so


def random_weight(qtype: T, shape: tuple[int, int, int], seed: int) -> QuantWeight:
    """Planes of the right shapes and dtypes with random bits; fp16 fields in [-2e-3, 2e-3]."""
    fmt = FORMATS[qtype]
    E, N, K = shape
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (1, K // fmt.block_size, fmt.type_size), dtype=torch.uint8, generator=g)
    row = fmt.pack(blocks)                                     # one row's planes, to learn widths and dtypes
    planes = {}
    for n in PLANES:
        if n not in row:
            continue
        p = row[n]
        if p.dtype == torch.float16:
            t = ((torch.rand(E, N, p.shape[1], generator=g) * 2 - 1) * 2e-3).half()
        else:
            t = torch.randint(-(1 << 30), 1 << 30, (E, N, p.shape[1]), dtype=torch.int64, generator=g).to(p.dtype)
            if qtype in (T.Q4_K, T.Q5_K) and n == "sc":
                t = t & 0x3F3F                                 # 6-bit sc and m
        planes[n] = t
    return QuantWeight(qtype, shape, planes)


def time_pool(threads: int | None = None, experts: int = 16, tasks: int = 4, posts: int = 200, D: int = 2048,
              F: int = 768, gate_up: T = T.Q4_K, down: T = T.Q6_K) -> dict:
    gu = random_weight(gate_up, (experts, 2 * F, D), 1)
    dn = random_weight(down, (experts, D, F), 2)
    mb = Mailbox.new(1, D, tasks)
    x = torch.randn(D)
    xq = torch.randint(-127, 128, (D,), dtype=torch.int8)
    mb.xq[0] = xq
    mb.dx[0] = x.abs().reshape(-1, 32).amax(-1) / 127
    mb.xs[0] = xq.to(torch.int32).reshape(-1, 16).sum(-1)
    mb.task.fill_(1)
    g = torch.Generator().manual_seed(0)
    times = []
    with CpuExperts({0: (gu, dn)}, mb, 1, threads=threads) as ce:
        for req in range(1, posts + 1):
            mb.ids[0] = torch.randperm(experts, generator=g)[:tasks].to(torch.int32)
            mb.ctl[LAYER], mb.ctl[ROWS] = 0, 1
            t0 = time.perf_counter()
            mb.ctl[REQ] = req
            while int(mb.ctl[DONE]) != req:
                pass
            times.append(time.perf_counter() - t0)
        n = ce.threads
    times = sorted(times[posts // 10:])                        # the first posts warm caches and threads
    per_expert = (gu.nbytes + dn.nbytes) / experts
    med = times[len(times) // 2]
    return {"threads": n, "experts": experts, "tasks": tasks, "shape": {"D": D, "F": F},
            "formats": [gate_up.name, down.name], "expert_mb": round(per_expert / 1e6, 3),
            "median_ms": round(med * 1e3, 4), "p10_ms": round(times[len(times) // 10] * 1e3, 4),
            "p90_ms": round(times[len(times) * 9 // 10] * 1e3, 4),
            "gb_per_s": round(tasks * per_expert / med / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--posts", type=int, default=200)
    ap.add_argument("--probe", action="store_true", help="also run the bandwidth probe")
    a = ap.parse_args()
    out = {"pool": time_pool(a.threads, a.experts, a.tasks, a.posts)}
    if a.probe:
        out["probe"] = probe()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

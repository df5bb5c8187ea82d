"""One MoE layer of the Qwen3-30B-A3B shape (128 experts, top-8, D 2048, F 768, gate|up
Q4_K, down Q6_K), timed as a captured CUDA graph at W = 1 and 8, in four arms:

    moe       kernels/moe/moe_f32.py (the resident path), experts in VRAM
    q8        the expert contract (kernels/moe/moe_q8.py), experts in the bank
    moe-pcie  kernels/moe/moe_f32.py, every expert in pinned host RAM read in place over PCIe
    q8-pcie   the contract, the same host tier
    q8-cpuN   the contract, every host pair computed by N native CPU workers (several N)

plus the contract's exactness on the GPU: the layer's output for a few rows equals the
plain-torch reference bit for bit. Writes $OUT/gpu_moe_q8-*.json; prints a table last.

    python bench/gpu_moe_q8.py [--reps 200] [--commit SHA]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.bench.engine_bench import time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.kernels.moe.expert_q8 import moe_q8 as moe_q8_ref
from alphallama.kernels.moe.moe_f32 import moe_down, moe_gate_up
from alphallama.kernels.moe.moe_q8 import moe_q8
from alphallama.kernels.formats.qweight import QuantWeight
from alphallama.offload.store import pin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kernels import random_raw  # noqa: E402


def random_weight(qtype: T, shape: tuple[int, ...], seed: int, device) -> QuantWeight:
    """Random GGUF blocks (gpu_kernels.random_raw: small fp16 scales) re-laid on `device`."""
    raw = random_raw(qtype, shape[0] * shape[1], shape[2], torch.Generator(device=device).manual_seed(seed))
    return QuantWeight.from_raw(raw, qtype, shape, device)


def host_copy(w: QuantWeight) -> QuantWeight:
    return QuantWeight(w.qtype, w.shape, {n: pin(p.cpu().clone()) for n, p in w.planes.items()})


def graph_ms(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return time_cuda(g.replay, reps, warm=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    ap.add_argument("--threads", type=int, default=None, help="CPU workers (default: the probe's choice)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    E, D, F, k = 128, 2048, 768, 8
    gu = random_weight(T.Q4_K, (E, 2 * F, D), 1, dev)
    dn = random_weight(T.Q6_K, (E, D, F), 2, dev)
    hgu, hdn = host_copy(gu), host_copy(dn)
    resident = torch.arange(E, dtype=torch.int32, device=dev)
    on_host = torch.full((E,), -1, dtype=torch.int32, device=dev)
    expert_bytes = (gu.nbytes + dn.nbytes) // E
    res: dict = {"host": host_state(), "commit": args.commit, "shape": {"E": E, "D": D, "F": F, "k": k,
                 "gate_up": "Q4_K", "down": "Q6_K", "expert_bytes": expert_bytes}, "arms": {}, "exact": {}}
    g = torch.Generator().manual_seed(0)

    # exactness on the GPU: bank and host tiers against the reference
    h = torch.randn(2, D, generator=g).to(dev)
    ex = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2)]).to(torch.int32).to(dev)
    wt = torch.rand(2, k, generator=g).to(dev)
    ref = moe_q8_ref(h, hgu, hdn, ex, wt)
    res["exact"]["bank"] = bool(torch.equal(moe_q8(h, wt, ex, gu, dn, gu, dn, resident, 0).cpu(), ref))
    res["exact"]["host"] = bool(torch.equal(moe_q8(h, wt, ex, hgu, hdn, gu, dn, on_host, 0).cpu(), ref))
    mixed = torch.where(torch.arange(E, device=dev) % 2 == 0, resident, on_host).to(torch.int32)
    res["exact"]["mixed"] = bool(torch.equal(moe_q8(h, wt, ex, hgu, hdn, gu, dn, mixed, 0).cpu(), ref))
    for c in (2, 4):
        res["exact"][f"mixed-c{c}"] = bool(torch.equal(moe_q8(h, wt, ex, hgu, hdn, gu, dn, mixed, 0, chunks=c).cpu(), ref))

    link = None
    try:
        from alphallama.offload.cpu_tier import CpuLink
        from alphallama.offload.mailbox import Mailbox
        from alphallama.offload.native.probe import probe, usable_cpus
        from alphallama.offload.native.workers import CpuExperts
        link = CpuLink(Mailbox.new(64, D, k), dev)
        res["cpu_probe"] = probe()
        counts = sorted({args.threads or res["cpu_probe"]["threads"], 2, 4, 8, len(usable_cpus())})
        res["thread_counts"] = counts
        with CpuExperts({0: (hgu, hdn)}, link.mailbox, 1, threads=counts[-1]):
            res["exact"]["cpu"] = bool(torch.equal(moe_q8(h, wt, ex, hgu, hdn, gu, dn, on_host, 0, link).cpu(), ref))
        link.check()
    except Exception as e:   # noqa: BLE001 (the workers are optional in this bench)
        res["cpu_workers_error"] = f"{type(e).__name__}: {e}"
        counts = []

    for W in (1, 8):
        x = torch.randn(W, D, generator=g).to(dev).to(torch.bfloat16)
        ex = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(W)]).to(torch.int32).to(dev)
        wt = torch.rand(W, k, generator=g).to(dev)
        arms = {
            "moe": lambda: moe_down(moe_gate_up(x, gu, ex, torch.bfloat16, 4), dn, ex, wt, 4),
            "q8": lambda: moe_q8(x, wt, ex, gu, dn, gu, dn, resident, 0),
            "moe-pcie": lambda: moe_down(moe_gate_up(x, hgu, ex, torch.bfloat16, 4, on_host, gu), hdn, ex, wt, 4,
                                         on_host, dn),
            "q8-pcie": lambda: moe_q8(x, wt, ex, hgu, hdn, gu, dn, on_host, 0),
            "q8-c2": lambda: moe_q8(x, wt, ex, gu, dn, gu, dn, resident, 0, chunks=2),
            "q8-c4": lambda: moe_q8(x, wt, ex, gu, dn, gu, dn, resident, 0, chunks=4),
            "q8-pcie-c2": lambda: moe_q8(x, wt, ex, hgu, hdn, gu, dn, on_host, 0, chunks=2),
            "q8-pcie-c4": lambda: moe_q8(x, wt, ex, hgu, hdn, gu, dn, on_host, 0, chunks=4),
        }
        for n in counts:   # every host pair to the CPU workers, n threads
            arms[f"q8-cpu{n}"] = (n, lambda: moe_q8(x, wt, ex, hgu, hdn, gu, dn, on_host, 0, link))
        for name, fn in arms.items():
            n, fn = fn if isinstance(fn, tuple) else (None, fn)
            try:
                pool = CpuExperts({0: (hgu, hdn)}, link.mailbox, 1, threads=n).start() if n else None
                ms = graph_ms(fn, args.reps if "pcie" not in name and "cpu" not in name else 50)
                if pool is not None:
                    pool.stop()
                    link.check()
                res["arms"].setdefault(name, {})[W] = {
                    "us": ms * 1e3, "expert_GBps": W * k * expert_bytes / (ms * 1e-3) / 1e9}
            except Exception as e:   # noqa: BLE001
                res["arms"].setdefault(name, {})[W] = {"error": f"{type(e).__name__}: {e}"}
    out = Path(os.environ.get("OUT", ".")) / f"gpu_moe_q8-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))
    print("exact:", res["exact"], res.get("cpu_workers_error", ""), "probe:", res.get("cpu_probe"))
    print(f"{'arm':10s} {'W=1 us':>10s} {'W=8 us':>10s} {'GB/s W=1':>9s}")
    for name, v in res["arms"].items():
        cells = [f"{v[W]['us']:10.1f}" if "us" in v[W] else f"{'err':>10s}" for W in (1, 8)]
        gbs = f"{v[1]['expert_GBps']:9.0f}" if "us" in v[1] else ""
        print(f"{name:10s} {cells[0]} {cells[1]} {gbs}")
        for W in (1, 8):
            if "error" in v[W]:
                print("   ", W, v[W]["error"][:300])


if __name__ == "__main__":
    main()

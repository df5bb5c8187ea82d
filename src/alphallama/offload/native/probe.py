"""Size the CPU expert pool to the host, not to the core count.

Expert matvecs stream weights from RAM, so a few threads saturate a host's memory
bandwidth and more only take cores from everything else. The probe times a streaming
read of a large buffer with 1, 2, 4, ... threads (pinned to the cpus the workers would
get) and takes the fewest threads within `probe_within` of the best bandwidth. The
cpu the launch thread (the caller) runs on is left out. On a host of several memory nodes
the cpus are the GPU's node's (offload/numa.py), and the probe's buffer lies there, as the
host tier does. The result is cached per host (and node) in ~/.cache/alphallama/cpu_probe.json.
"""
from __future__ import annotations

import ctypes
import os
import platform

import torch

from ...config import DEFAULTS
from ...private_dir import read_json, write_json
from .. import numa
from .build import cache_dir, lib


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def placement(device=None) -> numa.Placement | None:
    """The GPU's node and its allowed cpus on a host of several nodes (None: one node, no
    GPU, or its node unknown). device: the store's (None: the current CUDA device)."""
    return numa.gpu_placement(device, allowed_cpus())


def choose_cpus(allowed: list[int], here: int, placed: numa.Placement | None) -> list[int]:
    """The workers' cpus: the GPU's node's allowed cpus less `here` (the launch thread's cpu)
    where that leaves two or more; else the allowed cpus less `here`; on a one-cpu box, that cpu."""
    if placed is not None:
        on_node = [c for c in placed.cpus if c != here and c in allowed]
        if len(on_node) >= 2:
            return on_node
    rest = [c for c in allowed if c != here]
    return rest or allowed[:1]


def usable_cpus(device=None) -> list[int]:
    """The cpus the workers may take: this thread's affinity (on a host of several nodes, its
    cpus on the GPU's node) less the cpu it runs on now (the launch thread's)."""
    return choose_cpus(allowed_cpus(), lib().aq_current_cpu(), placement(device))


def bandwidth(cpus: list[int], nbytes: int, reps: int = 3, buf: torch.Tensor | None = None) -> float:
    """Bytes/s of len(cpus) pinned threads reading their shares of an nbytes buffer (best of reps)."""
    if buf is None:
        buf = torch.ones(nbytes // 8, dtype=torch.int64)   # touched: pages are mapped before timing
    arr = (ctypes.c_int * len(cpus))(*cpus)
    best = 0.0
    for _ in range(reps):
        best = max(best, lib().aq_probe_bandwidth(buf.data_ptr(), buf.numel() * 8, len(cpus), arr, 1))
    return best


def _host_key(nbytes: int, placed: numa.Placement | None = None) -> str:
    """The cache's key: host, cpu model, allowed cpus, probe size, and on a host of several
    nodes the node and its cpus the workers are chosen from (one node: the key as before)."""
    cpus = allowed_cpus()
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        pass
    node = "" if placed is None else f"|node={placed.node}:{','.join(map(str, placed.cpus))}"
    return f"{platform.node()}|{model}|cpus={','.join(map(str, cpus))}{node}|bytes={nbytes}"


def _probe_buffer(nbytes: int, placed: numa.Placement | None) -> torch.Tensor:
    """int64 [nbytes / 8], every page mapped; on the GPU's node where placed (as the host tier)."""
    if placed is None:
        return torch.ones(nbytes // 8, dtype=torch.int64)
    with numa.on_cpus(placed.cpus):
        return numa.touch_pages(torch.empty(nbytes // 8, dtype=torch.int64))


def probe(nbytes: int = DEFAULTS.offload.probe_bytes, within: float = DEFAULTS.offload.probe_within,
          cache: bool = True, device=None) -> dict:
    """{"threads": chosen count, "curve": {threads: GB/s}, "cpus": usable cpus, "cached": bool}.
    device: the GPU the workers serve (None: the current CUDA device), for its node."""
    placed = placement(device)
    cpus = choose_cpus(allowed_cpus(), lib().aq_current_cpu(), placed)
    key = _host_key(nbytes, placed)
    path = cache_dir() / "cpu_probe.json"
    saved = read_json(path) if cache else {}
    if key in saved:
        return {**saved[key], "cached": True}
    counts, n = [], 1
    while n < len(cpus):
        counts.append(n)
        n *= 2
    counts.append(len(cpus))
    buf = _probe_buffer(nbytes, placed)
    curve = {c: bandwidth(cpus[:c], nbytes, buf=buf) / 1e9 for c in counts}
    best = max(curve.values())
    threads = min(c for c, bw in curve.items() if bw >= within * best)
    result = {"threads": threads, "curve": {str(c): round(bw, 2) for c, bw in curve.items()}, "cpus": cpus,
              "probe_bytes": nbytes}
    if cache:
        saved[key] = result
        write_json(path, saved)
    return {**result, "cached": False}


def worker_cpus(threads: int | None = None, device=None) -> list[int]:
    """The cpus for `threads` workers (default: config's cpu_threads, else the probe's
    count), never the caller's own cpu where there is another; on a host of several nodes,
    the GPU's (device: the store's; None: the current CUDA device)."""
    cpus = usable_cpus(device)
    n = threads or DEFAULTS.offload.cpu_threads or probe(device=device)["threads"]
    if n < 1:
        raise ValueError(f"the CPU expert pool needs at least 1 thread, got {n}")
    return cpus[:min(n, len(cpus))]

"""The GPU's own timeline of a few decode rounds, from the profiler's kernel records (CUPTI:
kernels launched by a captured graph are recorded too), for the question a round's totals
cannot answer: where a store round's time goes on the device. The combine kernel spins until
the CPU workers' DONE, so its time is the GPU waiting for the CPU; the expert kernels are the
bank's and PCIe's work; the idle time is the graph's launches and gaps between kernels.

    with kernel_trace() as trace:
        decode(...)                                  # some rounds
    summary = summarize(trace.kernels, rounds)      # per kernel kind: count, us a round
"""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

KINDS = (("combine", ("q8_combine",)), ("post", ("q8_post",)), ("quantize", ("q8_quantize",)),
         ("experts", ("moe", "expert", "gate_up", "down")), ("attention", ("attn", "flash", "rope")))


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    dur_us: float


@dataclass
class Trace:
    kernels: list[Kernel] = field(default_factory=list)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def busy_us(kernels: list[Kernel]) -> float:
    """The union of the kernels' intervals: time at least one kernel ran."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        lo, hi = max(k.start_us, end), k.start_us + k.dur_us
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def summarize(kernels: list[Kernel], rounds: int) -> dict:
    """us a round by kernel kind and the window's idle time; rounds: the decode rounds the
    trace spans (the engine's count, not guessed from the kernels)."""
    if not kernels or rounds < 1:
        return {"kernels": len(kernels), "rounds": rounds}
    window = max(k.start_us + k.dur_us for k in kernels) - min(k.start_us for k in kernels)
    busy = busy_us(kernels)
    kinds: dict[str, dict] = {}
    for k in kernels:
        d = kinds.setdefault(kind_of(k.name), {"count": 0, "us": 0.0})
        d["count"] += 1
        d["us"] += k.dur_us
    return {"kernels": len(kernels), "rounds": rounds, "window_us_per_round": window / rounds,
            "busy_us_per_round": busy / rounds, "idle_us_per_round": (window - busy) / rounds,
            "per_round": {name: {"count": d["count"] / rounds, "us": d["us"] / rounds}
                          for name, d in sorted(kinds.items())}}


def kernels_of_chrome_trace(doc: dict) -> list[Kernel]:
    return [Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in doc.get("traceEvents", [])
            if e.get("cat") == "kernel" and "dur" in e]


@contextmanager
def kernel_trace():
    """Profile the block's CUDA kernels; trace.kernels is filled as the block exits (and
    stays empty without a GPU: nothing is profiled there)."""
    import torch
    trace = Trace()
    if not torch.cuda.is_available():
        yield trace
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield trace
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace.kernels = kernels_of_chrome_trace(json.load(f))
    finally:
        os.unlink(path)

"""The host's measured bandwidths for the plan's cost model (offload/estimate.py).

    ram         the CPU workers' cpus streaming through RAM (native/probe.py: the best of
                its thread counts, cached per host); torch's sum where no C compiler
    disk        the model file's pages read after dropping them from the page cache
                (fsync, posix_fadvise DONTNEED on one range of the file: a cold read;
                None where they stay cached, checked with mincore)
    page_cache  the same range read again (now cached)
    pcie        page-locked host -> device copies (CUDA only)
    gpu         device memory read + write by a device-to-device copy, counted as 2x the
                bytes (CUDA only)

Each probe reads a few hundred MiB at most (well under a second on a server). The
results are cached per host, file system and GPU in ~/.cache/alphallama/host_probe.json.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from ..private_dir import cache_dir, read_json, write_json

MiB = 1 << 20
FILE_PROBE = 64 * MiB   # the file range read cold, then cached


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second; None: not measurable here (no GPU)."""
    ram: float
    disk: float | None = None
    page_cache: float | None = None
    pcie: float | None = None
    gpu: float | None = None
    source: str = "measured"

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        def gb(v):
            return "n/a" if v is None else f"{v / 1e9:.1f} GB/s"
        return (f"RAM {gb(self.ram)}, disk {gb(self.disk)}, page cache {gb(self.page_cache)}, "
                f"PCIe {gb(self.pcie)}, GPU {gb(self.gpu)} ({self.source})")


def ram_rate() -> float:
    """The CPU workers' streaming rate (the native probe's best), else torch's sum's."""
    try:
        from .native.probe import probe
        return max(probe()["curve"].values()) * 1e9
    except (ImportError, OSError, RuntimeError):   # no C compiler (NativeBuildError is a RuntimeError)
        pass
    buf = torch.ones(64 * MiB // 8, dtype=torch.int64)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 8 / (time.perf_counter() - t0))
    return best


def resident_share(ranges: list[tuple[int, int]]) -> float:
    """The share of the pages of mapped memory ranges (address, bytes) that are in RAM
    (mincore; each range widened to whole pages)."""
    import ctypes
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    have = total = 0
    for addr, n in ranges:
        lo = addr - addr % page
        size = addr + n - lo
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        have += sum(v & 1 for v in vec)
        total += pages
    return have / total if total else 0.0


def cached_share(path: str, off: int, n: int) -> float:
    """The share of the file's pages in [off, off + n) that are in the page cache (on a fresh
    read-only mapping: mapping touches no page)."""
    import numpy as np
    page = os.sysconf("SC_PAGE_SIZE")
    lo = off - off % page
    m = np.memmap(path, dtype=np.uint8, mode="r", offset=lo, shape=(off + n - lo,))
    try:
        return resident_share([(m.ctypes.data, m.size)])
    finally:
        del m


def file_rates(path: str, nbytes: int = FILE_PROBE, chunk: int = 4 * MiB) -> tuple[float | None, float]:
    """(cold, cached) bytes/s reading the last `nbytes` of the file (its tensor data). cold is
    None where the pages could not be dropped from the page cache first (a process maps them,
    or the file system is memory: tmpfs), so no read here would come from the disk."""
    size = os.path.getsize(path)
    n = min(nbytes, size)
    off = size - n
    buf = bytearray(chunk)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read() -> float:
            t0 = time.perf_counter()
            pos = off
            while pos < size:
                got = os.preadv(fd, [memoryview(buf)[:min(chunk, size - pos)]], pos)
                if got <= 0:
                    break
                pos += got
            return n / max(time.perf_counter() - t0, 1e-9)
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.fsync(fd)          # dirty pages (a file just written or downloaded) are never dropped
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
            try:
                dropped = cached_share(path, off, n) < 0.5
            except OSError:       # no mincore here: trust the advice
                pass
        cold = read() if dropped else None
        cached = max(read() for _ in range(2))
    finally:
        os.close(fd)
    return cold, cached


def cuda_rates(nbytes: int = 256 * MiB) -> tuple[float, float]:
    """(pcie, gpu) bytes/s: pinned host -> device copies, and a device copy's read + write."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(dev)

    def timed(fn, moved: int) -> float:
        best = 0.0
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = max(best, moved / (a.elapsed_time(b) * 1e-3))
        return best
    pcie = timed(lambda: dev.copy_(host, non_blocking=True), nbytes)
    gpu = timed(lambda: other.copy_(dev), 2 * nbytes)
    return pcie, gpu


def _key(path: str) -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-gpu"
    return f"{platform.node()}|dev={os.stat(path).st_dev}|{gpu}|cpus={len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}"


def measure(path: str, cache: bool = True) -> Bandwidths:
    """The host's bandwidths as the plan prices them (cached per host, file system, GPU)."""
    store = cache_dir() / "host_probe.json"
    key = _key(path)
    saved = read_json(store) if cache else {}
    if key in saved:
        return Bandwidths(**{**saved[key], "source": "measured (cached)"})
    disk, page = file_rates(path, FILE_PROBE)
    pcie = gpu = None
    if torch.cuda.is_available():
        pcie, gpu = cuda_rates()
    small = os.path.getsize(path) < FILE_PROBE     # a small file's read rates are noise: not kept
    bw = Bandwidths(ram_rate(), disk, page, pcie, gpu, "measured (a small file: rough)" if small else "measured")
    if cache and not small:
        saved[key] = {k: v for k, v in bw.to_dict().items() if k != "source"}
        write_json(store, saved)
    return bw

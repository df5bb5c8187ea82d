"""Compile the CPU expert library at first use and load it with ctypes.

The sources ship with the package; the shared object is built with the host's C compiler
for the host's CPU (-march=native: the integer dot loops vectorize to what it has) into
~/.cache/alphallama/native/<sha of sources + flags + compiler>.so, by an atomic rename,
and reused after. -ffp-contract=off -fno-fast-math keep the float sequence the expert
contract fixes (no fused multiply-add, no reassociation).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = ("pool.c", "experts.c", "simd.c", "probe.c")   # pool.c includes the others
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread", "-std=gnu11")
MARCH = "native"   # the tests also build a generic x86-64 one: the scalar paths, held to the same bits


class NativeBuildError(RuntimeError):
    """No C compiler, or the library failed to build."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "alphallama"


def find_compiler() -> str:
    """The C compiler: $CC, then sysconfig's, then cc / gcc / clang on PATH."""
    names = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc", "clang"]
    for name in names:
        path = shutil.which(name) if name else None
        if path:
            return path
    raise NativeBuildError(
        "the CPU expert workers need a C compiler and none was found (tried $CC, sysconfig's CC, cc, gcc, "
        "clang). Install one (Debian/Ubuntu: apt-get install gcc; Fedora: dnf install gcc) or set CC.")


def library_path(cc: str, march: str = MARCH) -> Path:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((HERE / name).read_bytes())
    h.update(" ".join((*FLAGS, f"-march={march}")).encode())
    h.update(os.path.realpath(cc).encode())
    return cache_dir() / "native" / f"experts-{h.hexdigest()[:20]}.so"


def build(march: str = MARCH) -> Path:
    """The shared object for these sources, compiled if it is not in the cache yet."""
    cc = find_compiler()
    out = library_path(cc, march)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, f"-march={march}", "-o", tmp, str(HERE / SOURCES[0]), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise NativeBuildError(f"building the CPU expert library failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)   # atomic: a concurrent builder's file or ours, never a torn one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def lib(march: str = MARCH) -> ctypes.CDLL:
    """The loaded library, with argument types declared (one per process and -march)."""
    so = ctypes.CDLL(str(build(march)))
    P, I = ctypes.c_void_p, ctypes.c_int
    sigs = {
        "aq_quantize": (None, [P, I, P, P, P]),
        "aq_exp": (None, [P, I, P]),
        "aq_silu_mul": (None, [P, P, I, P]),
        "aq_prep": (I, [I, P, P, P, I, P]),
        "aq_matvec": (I, [P, I, P, I, I, P, P]),
        "aq_expert_ffn": (I, [P, I, P, P, P, P]),
        "aq_pool_start": (P, [I, P, P, P, P, P, P, P, P, I, I, I, P, I]),
        "aq_pool_stop": (None, [P]),
        "aq_probe_bandwidth": (ctypes.c_double, [P, ctypes.c_size_t, I, P, I]),
        "aq_slot_len": (I, [I]),
        "aq_current_cpu": (I, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(so, name)
        fn.restype, fn.argtypes = res, args
    return so

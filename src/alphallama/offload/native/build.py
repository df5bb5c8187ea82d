"""Compile the CPU expert library at first use and load it with ctypes.

The sources ship with the package; the shared object is built with the host's C compiler
for the host's CPU (-march=native: the integer dot loops vectorize to what it has) into
~/.cache/alphallama/native/<sha of sources + flags + compiler>.so, by an atomic rename,
and reused after, but only while it is provably ours: the directory is the user's own and
0700, the file the user's and not group/other-writable, and its sha256 the one recorded
beside it at build time; anything else is rebuilt, never loaded (a library is code run
with the user's rights). -ffp-contract=off -fno-fast-math keep the float sequence the
expert contract fixes (no fused multiply-add, no reassociation).
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

from ...private_dir import (
    UnsafePathError,
    cache_dir,
    digest_path,
    open_trusted,
    private_dir,
)

HERE = Path(__file__).parent
# pool.c includes the others
SOURCES = ("pool.c", "post.c", "experts.c", "acts.c", "simd.c", "gguf_rows.c", "group.c", "probe.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-pthread", "-std=gnu11")
MARCH = "native"   # the tests also build a generic x86-64 one: the scalar paths, held to the same bits


class NativeBuildError(RuntimeError):
    """No C compiler, or the library failed to build."""


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
    """Compile the library into the cache, recording its sha256 beside it: both land by
    atomic renames (a concurrent builder's files or ours, never a torn one; a library
    that ends up beside another build's hash fails verification and is rebuilt)."""
    cc = find_compiler()
    out = library_path(cc, march)
    _cache_dir(out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    side_fd, side_tmp = tempfile.mkstemp(suffix=".sha256", dir=out.parent)
    try:
        cmd = [cc, *FLAGS, f"-march={march}", "-o", tmp, str(HERE / SOURCES[0]), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise NativeBuildError(f"building the CPU expert library failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.chmod(tmp, 0o755)   # the linker honours the umask, which may leave it group-writable
        with open(tmp, "rb") as fh:
            os.write(side_fd, hashlib.sha256(fh.read()).hexdigest().encode() + b"\n")
        os.close(side_fd)
        side_fd = -1
        os.replace(side_tmp, digest_path(out))
        os.replace(tmp, out)
    finally:
        if side_fd >= 0:
            os.close(side_fd)
        for leftover in (tmp, side_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return out


def _cache_dir(path: Path) -> None:
    try:
        private_dir(path)
    except UnsafePathError as e:
        raise NativeBuildError(f"the CPU expert library cache is unsafe: {e}") from None


def load(march: str = MARCH) -> ctypes.CDLL:
    """The verified library (open_trusted), built first where the cache has none, or one
    that fails verification: never dlopen a file someone else could have written."""
    out = library_path(find_compiler(), march)
    _cache_dir(out.parent)
    fd, why = open_trusted(out)
    if fd is None:
        build(march)
        fd, why = open_trusted(out)
        if fd is None:
            raise NativeBuildError(f"the freshly built CPU expert library fails verification: {why}")
    if not os.path.isdir("/proc/self/fd"):
        os.close(fd)
        return ctypes.CDLL(str(out))
    # load what was verified, through the open fd, not whatever the path names now; the fd
    # stays open: dlopen knows a loaded library by its name, and a closed fd's number comes
    # back, so another build loaded through it would be handed this one (one fd a build:
    # lib() loads each once)
    return ctypes.CDLL(f"/proc/self/fd/{fd}")


@functools.cache
def lib(march: str = MARCH) -> ctypes.CDLL:
    """The loaded library, with argument types declared (one per process and -march)."""
    return declare(load(march))


def declare(so: ctypes.CDLL) -> ctypes.CDLL:
    """so with the argument and result types of its functions declared (the missing ones of
    an older build, a benchmark's baseline, are left out)."""
    P, I = ctypes.c_void_p, ctypes.c_int
    sigs = {
        "aq_quantize": (None, [P, I, P, P, P]),
        "aq_exp": (None, [P, I, P]),
        "aq_silu_mul": (None, [P, P, I, P]),
        "aq_act": (I, [I, P, P, I, P]),
        "aq_prep": (I, [I, P, P, P, I, P]),
        "aq_prep_group": (I, [I, P, P, P, I, P]),
        "aq_matvec": (I, [P, I, P, I, I, P, P]),
        "aq_matvec_group": (I, [P, I, P, I, I, I, P, P]),
        "aq_expert_ffn": (I, [P, I, P, P, P, P]),
        "aq_pool_start": (P, [I, P, P, P, P, P, P, P, P, I, I, I, P, I]),
        "aq_pool_stop": (None, [P]),
        "aq_pool_stats": (None, [P, P]),
        "aq_probe_bandwidth": (ctypes.c_double, [P, ctypes.c_size_t, I, P, I]),
        "aq_slot_len": (I, [I]),
        "aq_current_cpu": (I, []),
        "aq_repack_row": (I, [I, P, I, P, P, P, P]),
        "aq_relay_vectorized": (I, [I]),
        "aq_willneed": (I, [P, ctypes.c_size_t]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(so, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = res, args
    return so

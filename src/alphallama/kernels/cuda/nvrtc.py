"""Compile a packaged .cu source with NVRTC, cache the cubin, launch it on torch's stream.

    kernel = load("round_layer.cu", "round_layer")       # compiled once per arch and source
    kernel.launch(grid, block, smem, [ptr, ptr, ...])     # on torch.cuda.current_stream()

The cubin lands in ~/.cache/alphallama/cuda/<arch>/<key>.cubin, the key a sha256 of the
source, the options and NVRTC's version, beside its recorded sha256 (both by atomic
renames). It is loaded back only while provably ours: the directory the user's own and
0700 (private_dir), the file and its sidecar the user's and not group/other-writable, the
content's hash the recorded one (private_dir.open_trusted, the native expert
library's checks); anything else is recompiled, never loaded. A cubin is code run on the
GPU with the user's rights, like a .so.

cuda.bindings (cuda-python) is imported on the first compile or launch, never at import:
this module's cache and key logic run and are tested on machines without it or a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ...private_dir import (
    UnsafePathError,
    cache_dir,
    digest_path,
    open_trusted,
    private_dir,
)

OPTIONS = ("-std=c++17", "--fmad=false", "-lineinfo")   # no contraction: the float order is the source's


class CudaBuildError(RuntimeError):
    """NVRTC or the driver refused the source, or cuda-python is missing."""


def source(name: str) -> bytes:
    """A packaged .cu source's bytes."""
    return resources.files(__package__).joinpath(name).read_bytes()


def headers() -> tuple[tuple[str, bytes], ...]:
    """The packaged .cuh headers, (name, bytes), by name: handed to NVRTC in memory (no
    include path on disk) and part of every cache key."""
    files = resources.files(__package__)
    return tuple(sorted((f.name, f.read_bytes()) for f in files.iterdir() if f.name.endswith(".cuh")))


def arch_of(capability: tuple[int, int]) -> str:
    """(9, 0) -> 'sm_90': the NVRTC target, machine code for that GPU."""
    major, minor = capability
    return f"sm_{major}{minor}"


def cache_key(src: bytes, arch: str, options: tuple[str, ...], nvrtc_version: tuple[int, int],
              includes: tuple[tuple[str, bytes], ...] = ()) -> str:
    """What the cubin is a function of: source, headers, target, options, compiler version."""
    h = hashlib.sha256(src)
    for name, body in includes:
        h.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(body).digest())
    h.update(b"\0" + arch.encode() + b"\0" + " ".join(options).encode())
    h.update(b"\0nvrtc %d.%d" % nvrtc_version)
    return h.hexdigest()[:24]


def cubin_path(name: str, key: str, arch: str) -> Path:
    return cache_dir() / "cuda" / arch / f"{Path(name).stem}-{key}.cubin"


def cached_cubin(path: Path, owner: int | None = None) -> tuple[bytes | None, str]:
    """(the verified bytes, "") or (None, why not): the ownership and hash checks."""
    try:
        private_dir(path.parent, owner)
    except UnsafePathError as e:
        return None, str(e)
    fd, why = open_trusted(path, owner)
    if fd is None:
        return None, why
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    recorded = digest_path(path).read_text().strip()
    if hashlib.sha256(data).hexdigest() != recorded:   # changed since open_trusted hashed it
        return None, f"{path} changed while being read"
    return data, ""


def store_cubin(path: Path, data: bytes) -> None:
    """Write the cubin and its sha256 sidecar by atomic renames into a private directory."""
    try:
        private_dir(path.parent)
    except UnsafePathError as e:
        raise CudaBuildError(f"the CUDA kernel cache is unsafe: {e}") from None
    for target, body in ((digest_path(path), hashlib.sha256(data).hexdigest().encode() + b"\n"), (path, data)):
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        try:
            os.write(fd, body)
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        os.replace(tmp, target)


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as e:
        raise CudaBuildError("the CUDA C++ kernels need cuda-python: pip install cuda-bindings "
                             "(the NVRTC library comes with torch's CUDA wheels or nvidia-cuda-nvrtc)") from e
    return driver, nvrtc


def _check(result, what: str):
    """cuda.bindings calls return (status, *values): raise on a bad status."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise CudaBuildError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else values


def nvrtc_version() -> tuple[int, int]:
    _, nvrtc = _bindings()
    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


def compile_cubin(src: bytes, name: str, arch: str, options: tuple[str, ...] = OPTIONS,
                  includes: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """NVRTC: source (+ headers it may #include by name) -> cubin for `arch` (no GPU
    needed). The log is in the error."""
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(src, name.encode(), len(includes), [b for _, b in includes],
                                           [n.encode() for n, _ in includes]), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        if int(status) != 0:
            raise CudaBuildError(f"NVRTC could not compile {name} for {arch}:\n{log.decode(errors='replace')[-4000:]}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        out = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        return out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cubin_for(name: str, arch: str, options: tuple[str, ...] = OPTIONS) -> bytes:
    """The cached cubin of a packaged source for `arch`, compiled (and cached) if the
    cache has none that passes the checks."""
    src, inc = source(name), headers()
    path = cubin_path(name, cache_key(src, arch, options, nvrtc_version(), inc), arch)
    data, _ = cached_cubin(path)
    if data is None:
        data = compile_cubin(src, name, arch, options, inc)
        store_cubin(path, data)
    return data


@dataclass
class Kernel:
    """A loaded CUfunction; launch() puts it on torch's current stream."""
    function: object
    module: object
    max_smem: int = 0

    def launch(self, grid: int, block: int, smem: int, pointers: list[int]) -> None:
        """One launch; every argument a device pointer (or integer the size of one)."""
        import torch
        driver, _ = _bindings()
        if smem > self.max_smem:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self.function, attr, smem), "cuFuncSetAttribute")
            self.max_smem = smem
        vals = [ctypes.c_void_p(p) for p in pointers]
        arr = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(driver.cuLaunchKernel(self.function, grid, 1, 1, block, 1, 1, smem, stream,
                                     ctypes.addressof(arr), 0), "cuLaunchKernel")


@functools.cache
def load(name: str, function: str, device: int = 0) -> Kernel:
    """The kernel `function` of packaged source `name`, for torch's CUDA device `device`
    (its primary context, the one torch uses)."""
    import torch
    driver, _ = _bindings()
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{device}")              # torch's primary context, current on this thread
    _check(driver.cuInit(0), "cuInit")
    data = cubin_for(name, arch_of(torch.cuda.get_device_capability(device)))
    module = _check(driver.cuModuleLoadData(data), "cuModuleLoadData")
    fn = _check(driver.cuModuleGetFunction(module, function.encode()), "cuModuleGetFunction")
    return Kernel(fn, module)


def attributes(kernel: Kernel, threads: int = 0, smem: int = 0) -> dict:
    """The loaded function's registers, local (spill/stack) bytes a thread and static shared
    memory; with `threads`, how many CTAs of that size and `smem` fit an SM."""
    driver, _ = _bindings()
    A = driver.CUfunction_attribute
    out = {n: int(_check(driver.cuFuncGetAttribute(getattr(A, "CU_FUNC_ATTRIBUTE_" + n.upper()), kernel.function), n))
           for n in ("num_regs", "local_size_bytes", "shared_size_bytes", "max_threads_per_block")}
    if threads:
        if smem > kernel.max_smem:
            _check(driver.cuFuncSetAttribute(kernel.function, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                   "cuFuncSetAttribute")
            kernel.max_smem = smem
        out["blocks_per_sm"] = int(_check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(kernel.function, threads, smem),
                                          "cuOccupancyMaxActiveBlocksPerMultiprocessor"))
    return out

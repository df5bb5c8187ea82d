"""kernels/cuda/nvrtc.py on the CPU: the cubin cache's key and ownership checks, the
import with neither a GPU nor cuda-python, and NVRTC compiling the packaged source
(NVRTC needs no GPU; skipped, naming the package, where cuda-bindings is missing)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from alphallama.kernels.cuda import nvrtc


def test_arch_and_key():
    assert nvrtc.arch_of((9, 0)) == "sm_90" and nvrtc.arch_of((8, 9)) == "sm_89"
    base = nvrtc.cache_key(b"src", "sm_90", ("-O3",), (13, 0))
    assert base == nvrtc.cache_key(b"src", "sm_90", ("-O3",), (13, 0))
    others = {nvrtc.cache_key(b"src2", "sm_90", ("-O3",), (13, 0)), nvrtc.cache_key(b"src", "sm_89", ("-O3",), (13, 0)),
              nvrtc.cache_key(b"src", "sm_90", ("-O2",), (13, 0)), nvrtc.cache_key(b"src", "sm_90", ("-O3",), (13, 1))}
    assert base not in others and len(others) == 4
    assert nvrtc.cache_key(b"src", "sm_90", ("-O3",), (13, 0), (("a.cuh", b"x"),)) != base    # headers count


def test_cache_round_trip_and_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = nvrtc.cubin_path("round_layer.cu", "k" * 24, "sm_90")
    assert path.is_relative_to(tmp_path / "alphallama" / "cuda" / "sm_90")
    assert nvrtc.cached_cubin(path)[0] is None                      # nothing there yet
    nvrtc.store_cubin(path, b"\x7fELF cubin bytes")
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert nvrtc.cached_cubin(path) == (b"\x7fELF cubin bytes", "")
    data, why = nvrtc.cached_cubin(path, owner=os.geteuid() + 1)    # another user's cache: refused
    assert data is None and "uid" in why
    os.chmod(path, 0o620)                                           # group-writable: refused
    data, why = nvrtc.cached_cubin(path)
    assert data is None and "writable" in why
    os.chmod(path, 0o600)
    path.write_bytes(b"\x7fELF planted")                            # content not the recorded hash: refused
    data, why = nvrtc.cached_cubin(path)
    assert data is None and "sha256" in why


def test_imports_without_cuda_python_or_gpu():
    """The module imports (and says what to install at first use) where `cuda` cannot be
    imported; the CPU path never imports kernels/cuda."""
    code = """
import sys
class NoCuda:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoCuda())
import alphallama, alphallama.cli, alphallama.engine
assert not any(m.startswith("alphallama.kernels.cuda") for m in sys.modules), "the CPU path imported kernels/cuda"
from alphallama.kernels.cuda import nvrtc, schedule
try:
    nvrtc.nvrtc_version()
except nvrtc.CudaBuildError as e:
    print("refused:", e)
"""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "cuda-bindings" in r.stdout


def test_packaged_source_compiles_for_hopper():
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda-bindings (cuda-python) is not installed: NVRTC unavailable")
    try:
        version = nvrtc.nvrtc_version()
    except (nvrtc.CudaBuildError, OSError, RuntimeError) as e:
        pytest.skip(f"libnvrtc not loadable (pip install nvidia-cuda-nvrtc): {e}")
    assert [n for n, _ in nvrtc.headers()] == ["round_attn.cuh", "round_common.cuh", "round_gemv.cuh"]
    cubin = nvrtc.compile_cubin(nvrtc.source("round_layer.cu"), "round_layer.cu", "sm_90", includes=nvrtc.headers())
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 10_000, version
    with pytest.raises(nvrtc.CudaBuildError, match="could not compile"):
        nvrtc.compile_cubin(b"__global__ void k( { }", "bad.cu", "sm_90")

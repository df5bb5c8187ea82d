"""The CPU golden record's host: the numerics it is made under, and their fingerprint.

On the CPU the golden bits go through libraries that pick their kernels by the host CPU
when they load: MKL's sgemm (the prefill path's GEMMs, SDPA's products), numpy's
OpenBLAS sgemm (the Triton interpreter's tl.dot), ATen's and numpy's vectorized kernels
(softmax, exp, reductions, and torch.randn in the synthetic models' weights). Records
written on an Intel (AMX) host differed on an AMD EPYC in every bits leaf of the presets
whose prefill runs MKL's sgemm; the plan was identical. So the CPU record is made in a
child process whose environment pins each library to one code path that every x86-64
host with AVX2 runs alike (PINS), with one thread; the child also hashes a few probe ops
under the same pins (fingerprint): two hosts with one fingerprint compute those
libraries' float orders alike, and the record's bits are compared byte for byte there.

    pinned_record("tiny-qwen2")     # the record, made in a pinned child (tests, --write)
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# One code path for each library, where the host has AVX2 (x86-64-v3); elsewhere only THREADS
X86_PINS = {
    "MKL_CBWR": "COMPATIBLE",           # MKL's branch that Intel and AMD run alike (AVX2/AVX512 ones are Intel-only)
    "OPENBLAS_CORETYPE": "Haswell",     # numpy's OpenBLAS: the AVX2 kernels, not SkylakeX / SapphireRapids / Zen
    "ATEN_CPU_CAPABILITY": "avx2",      # torch's vectorized kernels: AVX2, not AVX512
    "NPY_ENABLE_CPU_FEATURES": "X86_V3",  # numpy's SIMD dispatch up to AVX2 (no AVX512_SKX/ICL/SPR loops)
    "ONEDNN_MAX_CPU_ISA": "AVX2",       # torch's oneDNN primitives, should any op take one
}
CHILD_TIMEOUT_S = 1800   # one preset's record takes ~1-3 min on a busy 2-core host


def _numpy_knows_v3() -> bool:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats
    except ImportError:
        return False
    return bool(feats.get("X86_V3"))


def pins() -> dict[str, str]:
    """The environment the CPU record is made under on this host."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return dict(THREADS)
    x86 = {k: v for k, v in X86_PINS.items() if k != "NPY_ENABLE_CPU_FEATURES" or _numpy_knows_v3()}
    return THREADS | x86


def pinned() -> bool:
    return all(os.environ.get(k) == v for k, v in pins().items())


def child_env() -> dict[str, str]:
    """This environment with the pins, the interpreter, and this alphallama first on the path."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return os.environ | pins() | {"TRITON_INTERPRET": "1", "PYTHONPATH": path}


def run_pinned(argv: list[str], capture: bool = False) -> subprocess.CompletedProcess:
    """`python -m alphallama.runtime.gpu_golden ARGV` in a pinned child."""
    return subprocess.run([sys.executable, "-m", "alphallama.runtime.gpu_golden", *argv], env=child_env(),
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None,
                          text=True, timeout=CHILD_TIMEOUT_S, check=False)


def pinned_record(name: str) -> dict:
    """The CPU golden record of preset `name`, made in a pinned child."""
    p = run_pinned(["--device", "cpu", "--presets", name], capture=True)
    if p.returncode != 0:
        raise RuntimeError(f"the pinned golden run of {name} exited {p.returncode}:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout)


# -- the fingerprint --------------------------------------------------------------------
def _data(g: torch.Generator, *shape: int) -> torch.Tensor:
    """float32 of full mantissas that every host makes alike: integers through one
    correctly rounded division (torch.randn's bits depend on the vector kernels)."""
    return torch.randint(-(1 << 20), 1 << 20, shape, generator=g).float() / 3001.0


def _sha(a) -> str:
    a = a.detach().contiguous().numpy() if isinstance(a, torch.Tensor) else np.ascontiguousarray(a)
    return hashlib.sha256(a.tobytes()).hexdigest()[:12]


def probes() -> dict[str, str]:
    """Hashes of the ops whose kernels the libraries choose by host, at the golden's shapes."""
    g = torch.Generator().manual_seed(0)
    x, w, s = _data(g, 71, 256), _data(g, 384, 256), _data(g, 5, 64)
    q, k, v = (_data(g, 1, 4, 71, 32) / 64 for _ in range(3))
    out = {
        "torch.mm": _sha(torch.mm(x, w.T)),                       # MKL sgemm, the prefill GEMM's form
        "torch.mm narrow": _sha(torch.mm(s, w[:, :64].T)),
        "sdpa causal": _sha(F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "sdpa prefix": _sha(F.scaled_dot_product_attention(q[:, :, :8], k, v, attn_mask=causal_lower_right(8, 71))),
        "softmax": _sha(torch.softmax(x / 16, -1)),
        "exp": _sha(torch.exp(x / 256)),
        "rsqrt": _sha(torch.rsqrt(x.abs() + 1)),
        "silu": _sha(F.silu(x)),
        "sum": _sha(x.sum(-1)),
        "double mean": _sha(x.double().square().mean().sqrt()),
        "randn": _sha(torch.randn(4096, generator=torch.Generator().manual_seed(1))),
    }
    xn, wn = x.numpy(), w.numpy()
    for m, kk, n in ((16, 32, 16), (64, 64, 64), (32, 128, 64)):  # the interpreter's tl.dot tiles
        out[f"np.matmul {m}x{kk}x{n}"] = _sha(np.matmul(xn[:m, :kk], wn[:n, :kk].T.copy()))
    out["np.matmul f16"] = _sha(np.matmul(xn[:16, :32].astype(np.float16), wn[:16, :32].T.astype(np.float16),
                                          dtype=np.float32))
    out |= {"np.exp": _sha(np.exp(xn / 256)), "np.sum": _sha(xn.sum(-1)), "np.sqrt": _sha(np.sqrt(np.abs(xn))),
            "np.log": _sha(np.log(np.abs(xn) + 1))}
    return out


def versions() -> dict[str, str]:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "absent"
    # torch without its local tag: a CUDA build's CPU kernels are the CPU build's (the probes check)
    return {"torch": torch.__version__.split("+")[0], "numpy": np.__version__, "triton": tv}


def host() -> dict:
    """What a CPU record says of the numerics it was made under: the pins, the versions
    and the probes' hashes, and their fingerprint (one hash of versions and probes)."""
    p, v = probes(), versions()
    fp = hashlib.sha256(json.dumps({"probes": p, "versions": v}, sort_keys=True).encode()).hexdigest()[:16]
    return {"fingerprint": fp, "pins": pins(), "probes": p, "versions": v}


def host_difference(want: dict, got: dict) -> str:
    """What differs between two records' hosts: the versions and the probes, by name."""
    parts = [f"{k} {want['versions'].get(k)} -> {v}" for k, v in got["versions"].items()
             if want["versions"].get(k) != v]
    probes = [k for k, v in got["probes"].items() if want["probes"].get(k) != v]
    if probes:
        parts.append("probes " + ", ".join(probes))
    if want["pins"] != got["pins"]:
        parts.append(f"pins {want['pins']} -> {got['pins']}")
    return "; ".join(parts) or "nothing but the fingerprint"


# -- values on a host of other numerics ---------------------------------------------------
_SCALE = {"logits": "rms", "max": "rms", "rms": "rms", "hidden": "hidden_rms", "hidden_rms": "hidden_rms"}


def values_beyond(want: dict, got: dict, tol: float, path: str = "") -> list[str]:
    """Each row of `got` (gpu_golden's `values`) with a value farther from `want`'s than
    `tol` times the row's scale (its logits' RMS, or its hidden RMS), as 'path: want !=
    got' (its first such value); [] where all are within. Rows that are not there in both
    are a difference too."""
    if isinstance(want, dict) and "row" in want:
        for k, sc in _SCALE.items():
            a, b = want[k], got.get(k)
            pairs = zip(a, b) if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) else [(a, b)]
            for i, (x, y) in enumerate(pairs):
                if not isinstance(y, (int, float)) or abs(x - y) > tol * want[sc]:
                    return [f"{path}/{k}[{i}]: golden {x!r} != now {y!r} (tolerance {tol * want[sc]:.3g})"]
        return []
    if isinstance(want, dict) and isinstance(got, dict) and set(want) == set(got):
        return [d for k in want for d in values_beyond(want[k], got[k], tol, f"{path}/{k}")]
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in values_beyond(a, b, tol, f"{path}[{i}]")]
    return [f"{path}: golden and now hold different rows"]

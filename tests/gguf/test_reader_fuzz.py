"""Fuzzing the GGUF header: seeded mutations of real small files (the embedded model, its
MTP sidecar, a synthetic tiny-llama from our writer) must each read as a self-consistent model or fail
with one GGUFError line: never another exception, a hang or a huge allocation.

The mutations (fuzz_worker.py) overwrite integers at positions gguf.GGUFReader parsed
(counts, string and array lengths, value types, tensor dims, types and offsets) with edge
and neighbour values, flip header bytes, and truncate. Against the reader before the
tensor-table checks, ~10% of these cases loaded files whose tensors overlap, are
misaligned or empty: models that compute garbage.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alphallama.gguf.arch import SIDECAR_SUFFIX
from alphallama.gguf.writer import PRESETS, write_synthetic

WORKER = Path(__file__).with_name("fuzz_worker.py")
EMBEDDED = Path(__file__).resolve().parents[2] / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"


def _fuzz(source: Path, work: Path, seed: int, n_cases: int, *model: Path) -> dict:
    r = subprocess.run([sys.executable, str(WORKER), str(source), str(work), str(seed), str(n_cases), *map(str, model)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("fuzz") / "tiny-llama.gguf"
    write_synthetic(PRESETS["tiny-llama"](seed=3), p)
    return p


@pytest.mark.parametrize("which,seed,n_cases", [("embedded", 20261203, 400), ("tiny-llama", 7, 1500),
                                                 ("embedded-mtp-sidecar", 11, 500)])
def test_mutated_headers_read_consistently_or_fail_clearly(tmp_path, tiny_llama, which, seed, n_cases):
    if which == "embedded-mtp-sidecar":   # the sidecar beside the intact model
        result = _fuzz(EMBEDDED.with_name(EMBEDDED.stem + SIDECAR_SUFFIX), tmp_path / f"m{SIDECAR_SUFFIX}",
                       seed, n_cases, EMBEDDED)
    else:
        result = _fuzz(EMBEDDED if which == "embedded" else tiny_llama, tmp_path / "work.gguf", seed, n_cases)
    assert result["failures"] == [], "\n".join(result["failures"][:20])
    counts = result["outcomes"]
    assert sum(counts.values()) == n_cases
    # the cases reach both sides: most mutations are refused, some give a valid file
    assert counts.get("rejected", 0) > n_cases // 3 and counts.get("accepted", 0) > n_cases // 20, counts

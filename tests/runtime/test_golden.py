"""The GPU runtime against its golden records (runtime/gpu_golden.py, issue 30): the kernel
plan for W = 1..64 and the logits' bits, regenerated here and compared byte for byte
with tests/data/golden/<device>-<preset>.json, which the refactor must reproduce.
Regenerate (only for an intended change of plan or bits, said so in the commit):
    python -m alphallama.runtime.gpu_golden --device cpu --write
    python -m alphallama.runtime.gpu_golden --device cuda --out tests/data/golden   (on a GPU)
Besides the byte equality, each record is checked for the bit contracts it holds: a
row's bits do not depend on W, and fast mode's narrow rounds are plain decode's bits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alphallama.runtime import gpu_golden as golden

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parents[1] / "data" / "golden"
CPU_PRESETS = [n for n in golden.CASES if n not in golden.GPU_ONLY]


def _golden(dev: str, name: str) -> dict:
    path = DATA / f"{dev}-{name}.json"
    if not path.exists():
        pytest.fail(f"{path} is missing: python -m alphallama.runtime.gpu_golden --device {dev} --write")
    return json.loads(path.read_text())


def _check(want: dict, got: dict, path: str) -> None:
    diff = golden.first_difference(want, got)
    assert diff is None, f"{path} differs at {diff}"
    assert golden.dumps(got) == golden.dumps(want), f"{path}: equal data but not its bytes"


def _rows_invariant(v: dict, what: str) -> None:
    """Row i of every verify round is the same token at the same position after the same
    prefix: its bits are the widest round's row i (exact mode)."""
    widest = v[str(max(map(int, v)))]["rows"]
    for W, r in v.items():
        assert r["rows"] == widest[:int(W)], f"{what} W={W}: a row's bits depend on the round's width"


def _contracts(rec: dict) -> None:
    """Rows invariant in W (the default and the gemv_mma models); the fast-mode model's
    rounds of up to `narrow` rows, and its W = 1 last prompt row, are the exact model's."""
    v = rec["bits"]["verify"]
    _rows_invariant(v, "default")
    if "bits" in rec.get("gemv_mma", {}):
        _rows_invariant(rec["gemv_mma"]["bits"]["verify"], "gemv_mma")
    if "fast" in rec:
        f = rec["fast"]
        assert f["bits"]["last_row"] == rec["bits"]["last_row"], "fast mode's W = 1 row is not plain decode's"
        for W, r in f["bits"]["verify"].items():
            if int(W) <= f["narrow"]:
                assert r == v[W], f"fast mode's narrow round W={W} is not the exact bits"


@pytest.mark.parametrize("name", CPU_PRESETS)
def test_cpu_golden(name, tmp_path):
    want = _golden("cpu", name)
    got = golden.record(name, "cpu", golden.CPU_WIDTHS, tmp_path)
    _check(want, json.loads(golden.dumps(got)), f"cpu-{name}.json")
    _contracts(got)


@pytest.mark.parametrize("name", list(golden.CASES))
def test_gpu_golden(name, tmp_path):
    path = DATA / f"gpu-{name}.json"
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: {path.name} is checked on a GPU")
    want = _golden("gpu", name)
    got = golden.record(name, "cuda", golden.WIDTHS, tmp_path, mma_bits=True)
    _check(want, json.loads(golden.dumps(got)), path.name)
    _contracts(got)


def test_first_difference_names_the_weight_and_width():
    """The diff message walks width ranges width by width."""
    a = {"layers": [{"o": {"per_W": {"1-4": {"BN": 4}, "5-64": {"BN": 8}}}}]}
    b = {"layers": [{"o": {"per_W": {"1-2": {"BN": 4}, "3-64": {"BN": 8}}}}]}
    assert golden.first_difference(a, a) is None
    assert golden.first_difference(a, b) == "/layers[0]/o/per_W/W=3/BN: golden 4 != now 8"
    assert golden.first_difference({"x": 1}, {}) == "/x: missing in the new record"

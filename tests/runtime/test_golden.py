"""The GPU runtime against its golden records (runtime/gpu_golden.py, issue 30): the kernel
plan for W = 1..64 and the logits' bits, regenerated here and compared byte for byte
with tests/data/golden/<device>-<preset>.json, which the refactor must reproduce.
Regenerate (only for an intended change of plan or bits, said so in the commit):
    python -m alphallama.runtime.gpu_golden --device cpu --write
    python -m alphallama.runtime.gpu_golden --device cuda --out tests/data/golden   (on the H200)
(another card's record where its bits differ: gpu-<preset>@<card>.json, see test_gpu_golden)
Besides the byte equality, each record is checked for the bit contracts it holds: a
row's bits do not depend on W, and fast mode's narrow rounds are plain decode's bits.

The CPU bits are the host libraries' float orders as much as ours: MKL and OpenBLAS
pick their sgemm kernels, ATen and numpy their vector kernels, by the CPU they load on
(records written on an Intel host differed on an AMD EPYC in every bits leaf of the
prefill path and all that follows it). So a CPU record is made in a child process under
pinned numerics (runtime/gpu_golden_host.py: one code path per library that every
x86-64 host with AVX2 runs alike, one thread), and carries their fingerprint: the
versions of torch, numpy and triton and the hashes of probe ops (the GEMMs, SDPA, the
vector math, the interpreter's dot) run under the same pins. Hence two CPU tests:
- test_cpu_golden_bits: where this host's fingerprint is the record's (expected on any
  such host with the same torch, numpy and triton), the whole record byte for byte: the
  host computes as the record's did, so a difference is our code's. Where the
  fingerprint differs it skips, naming what differs: no bits can prove anything there.
- test_cpu_golden, on every host, what another host's numerics cannot change: the plan
  (kernels, tiles, forms: integers and names) and the bit contracts (each compares bits
  of one run with bits of the same run), exactly; and the record's `values` (a few logits
  and hidden values of some rows) within VALUES_TOL of the row's RMS. Lifting the pins
  one at a time on one host moved them by up to 2e-3 of the RMS (OpenBLAS's other sgemm
  kernel: another order of the same sums flips an int8 activation's rounding, a step of
  1/127 of a row's largest value; MKL's moved them 1e-5, but for the MoE model's rows
  whose router nearly tied, 2e-2: up to 2 such rows are let be). VALUES_TOL is 25 times the
  largest: a difference beyond it is not another order of the same sums but another
  computation (a kernel, a weight, a layer wrong), so our code changed. What a host of
  other numerics cannot catch is a change of ours that only reorders sums: the byte
  comparison on a host of the record's fingerprint does."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from alphallama.runtime import gpu_golden as golden
from alphallama.runtime import gpu_golden_host as golden_host

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).resolve().parents[1] / "data" / "golden"
CPU_PRESETS = [n for n in golden.CASES if n not in golden.GPU_ONLY]
VALUES_TOL = 5e-2   # of a row's RMS; other float orders on one host: <= 2e-3 (see the docstring)


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


def _host_independent(rec: dict) -> dict:
    """What no host's numerics change: the preset, widths and every model's plan."""
    keep = {k: rec[k] for k in ("preset", "n_layers", "widths", "plan")}
    for sub in ("fast", "gemv_mma"):
        if sub in rec:
            keep[sub] = {k: rec[sub][k] for k in ("narrow", "plan")}
    return keep


@pytest.fixture(scope="module", params=CPU_PRESETS)
def cpu_pair(request) -> tuple[str, dict, dict]:
    """(preset, its golden record, the record made now in a pinned child)."""
    name = request.param
    return name, _golden("cpu", name), golden_host.pinned_record(name)


def test_cpu_golden(cpu_pair):
    name, want, got = cpu_pair
    diff = golden.first_difference(_host_independent(want), _host_independent(got))
    assert diff is None, f"cpu-{name}.json differs at {diff}"
    _contracts(got)
    # an MoE router's top-k is discontinuous: where two experts nearly tie, another float
    # order may pick the other one and that row moves far (seen: 2 rows of 9 moved 2e-2)
    flips = 2 if any("moe" in L for L in want["plan"]["layers"]) else 0
    models = [(want, got, "")] + ([(want["fast"], got["fast"], "/fast")] if "fast" in want else [])
    for w, g, where in models:
        far = golden_host.values_beyond(w["values"], g["values"], VALUES_TOL, f"{where}/values")
        assert len(far) <= flips, (f"cpu-{name}.json: {far}: beyond what another float order moves "
                                   f"(host: {golden_host.host_difference(want['host'], got['host'])})")


def test_cpu_golden_bits(cpu_pair):
    name, want, got = cpu_pair
    if got["host"]["fingerprint"] != want["host"]["fingerprint"]:
        pytest.skip(f"cpu-{name}.json's bits were made under numerics fingerprint {want['host']['fingerprint']}, "
                    f"this host's is {got['host']['fingerprint']} "
                    f"({golden_host.host_difference(want['host'], got['host'])}): its plan, bit contracts and "
                    f"values are checked by test_cpu_golden")
    _check(want, got, f"cpu-{name}.json")


def card_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    return "-".join(w.lower() for w in name.split() if w.upper() != "NVIDIA")


@pytest.mark.parametrize("name", list(golden.CASES))
def test_gpu_golden(name, tmp_path):
    """gpu-<preset>.json was made on the H200. Where another card's bits differ (the 8B
    shape's on the H100: the tree before the house gives the H100 the same other bits, so
    the card, not our code, makes them), its record gpu-<preset>@<card>.json holds them, and
    its plan is the H200 record's: the plan depends on no card."""
    path = DATA / f"gpu-{name}.json"
    if not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: {path.name} is checked on a GPU")
    want = _golden("gpu", name)
    own = DATA / f"gpu-{name}@{card_slug(torch.cuda.get_device_name())}.json"
    if own.exists():
        card = json.loads(own.read_text())
        assert golden.first_difference(_host_independent(want), _host_independent(card)) is None
        want, path = card, own
    got = golden.record(name, "cuda", golden.WIDTHS, tmp_path, mma_bits=True)
    _check(want, json.loads(golden.dumps(got)), path.name)
    _contracts(got)


def test_card_slug():
    assert card_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert card_slug("NVIDIA H200") == "h200"


def test_first_difference_names_the_weight_and_width():
    """The diff message walks width ranges width by width."""
    a = {"layers": [{"o": {"per_W": {"1-4": {"BN": 4}, "5-64": {"BN": 8}}}}]}
    b = {"layers": [{"o": {"per_W": {"1-2": {"BN": 4}, "3-64": {"BN": 8}}}}]}
    assert golden.first_difference(a, a) is None
    assert golden.first_difference(a, b) == "/layers[0]/o/per_W/W=3/BN: golden 4 != now 8"
    assert golden.first_difference({"x": 1}, {}) == "/x: missing in the new record"


def test_values_beyond_scales_by_the_rows_rms():
    """A value is within when its distance is at most tol times its row's RMS (logits'
    or hidden's); the message names the row's field and the tolerance."""
    row = {"row": 0, "logits": [1.0, -2.0], "max": 3.0, "rms": 2.0, "hidden": [0.5], "hidden_rms": 0.1}
    want = {"prefill": [row], "verify": {"5": [row]}}
    near = {"prefill": [row | {"logits": [1.0 + 0.099, -2.0]}], "verify": {"5": [row]}}
    far = {"prefill": [row], "verify": {"5": [row | {"hidden": [0.5 + 0.0051]}]}}
    assert golden_host.values_beyond(want, want, VALUES_TOL) == []
    assert golden_host.values_beyond(want, near, VALUES_TOL) == []               # 0.099 <= 0.05 * 2.0
    [diff] = golden_host.values_beyond(want, far, VALUES_TOL)
    assert diff.startswith("/verify/5[0]/hidden[0]: golden 0.5 != now 0.5051")
    assert "different rows" in golden_host.values_beyond(want, {"prefill": [row]}, VALUES_TOL)[0]


def test_the_pins_reach_the_child():
    """The child's environment holds every pin of this host, the interpreter, and this
    checkout's src first on the path (the record is of this code)."""
    env = golden_host.child_env()
    assert all(env[k] == v for k, v in golden_host.pins().items())
    assert env["TRITON_INTERPRET"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(golden.__file__).resolve().parents[2])

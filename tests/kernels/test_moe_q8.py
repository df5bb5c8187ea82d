"""The contract's Triton kernels (moe_q8.py: expert_q8_gpu.py's around moe_i8's CONTRACT
form) bit for bit against the plain-torch reference (expert_q8.moe_q8), for every format,
with experts in the bank and in the host tier, 64 lanes and ragged rows among them; and a
row's bits independent of W and its position.
On CPU the Triton interpreter runs them at small sizes; on a GPU, compiled."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.moe.expert_q8 import moe_q8 as moe_q8_ref  # noqa: E402
from alphallama.kernels.moe.moe_q8 import moe_q8  # noqa: E402
from tests.kernels.test_qmatmul import random_raw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("one_thread")
# (gate|up type, down type): the pairs of real files plus every type once
CASES = [(T.Q4_K, T.Q6_K), (T.Q5_K, T.Q4_K), (T.Q8_0, T.Q5_0), (T.Q4_0, T.Q8_0)]


def _layer(gt: T, dt: T, E: int, D: int, F: int, seed: int):
    gu = QuantWeight.from_raw(random_raw(gt, E * 2 * F, D, seed), gt, (E, 2 * F, D), DEV)
    dn = QuantWeight.from_raw(random_raw(dt, E * D, F, seed + 1), dt, (E, D, F), DEV)
    return gu, dn


def _bank(w: QuantWeight, experts: list[int]) -> QuantWeight:
    return QuantWeight(w.qtype, (len(experts), *w.shape[1:]), {n: p[experts].clone() for n, p in w.planes.items()})


@pytest.mark.parametrize("gt,dt,F", [(*c, 256) for c in CASES] + [(T.Q4_K, T.Q6_K, 8448), (T.Q5_K, T.Q4_0, 96)],
                         ids=[f"{a.name}-{b.name}" for a, b in CASES] + ["Q6_K-64-lanes", "Q4_0-3-slots"])
def test_moe_q8_matches_reference(gt, dt, F):
    """F 8448: down's Q6_K rows of 528 slots (64 lanes, ragged); F 96: 3 slots of Q4_0."""
    E, D, k, W = 4, 256, 2, 3
    gu, dn = _layer(gt, dt, E, D, F, seed=11)
    bank_gu, bank_dn = _bank(gu, [2, 0]), _bank(dn, [2, 0])
    table = torch.tensor([1, -1, 0, -1], dtype=torch.int32, device=DEV)        # experts 0, 2 in the bank
    g = torch.Generator().manual_seed(12)
    h = (torch.randn(W, D, generator=g) * 3).to(DEV)
    h[1, :32] = 0                                                                # an all-zero block
    experts = torch.tensor([[0, 1], [3, 2], [2, 0]], dtype=torch.int32, device=DEV)
    weights = torch.rand(W, k, generator=g).to(DEV)
    out = moe_q8(h, weights, experts, gu, dn, bank_gu, bank_dn, table, layer=0)
    ref = moe_q8_ref(h, gu, dn, experts, weights)
    assert out.dtype == torch.float32
    assert torch.equal(out.cpu(), ref), f"max diff {(out.cpu() - ref).abs().max():.3g}"
    # the same row alone, and at another position: the same bits
    one = moe_q8(h[2:3], weights[2:3], experts[2:3], gu, dn, bank_gu, bank_dn, table, layer=0)
    assert torch.equal(one.cpu()[0], out.cpu()[2])


@pytest.mark.skipif(DEV == "cuda", reason="the plain-torch path is taken for CPU tensors without the interpreter")
def test_without_triton_the_reference_and_no_cpu_tier(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # read at call time (qmatmul.use_triton)
    gu, dn = _layer(T.Q4_K, T.Q6_K, 3, 256, 256, seed=13)
    table = torch.tensor([0, -1, -1], dtype=torch.int32)
    h = torch.randn(2, 256, generator=torch.Generator().manual_seed(14))
    experts = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=torch.Generator().manual_seed(15))
    out = moe_q8(h, weights, experts, gu, dn, _bank(gu, [0]), _bank(dn, [0]), table, layer=0)
    assert torch.equal(out, moe_q8_ref(h, gu, dn, experts, weights))
    with pytest.raises(ValueError, match="needs the Triton kernels"):
        moe_q8(h, weights, experts, gu, dn, _bank(gu, [0]), _bank(dn, [0]), table, layer=0, link=object())

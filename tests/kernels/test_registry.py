"""The decode GEMV registry and its plans (kernels/gemv/registry.py): what each entry says it
takes, the plan a Linear gets for W = 1..64, and exact mode's check that a weight keeps one
bits family across widths (a check that fails where a plan mixes them)."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T


from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402
from alphallama.kernels.gemv.q8k_act import Q8K  # noqa: E402
from alphallama.kernels.gemv.qmatvec_i8 import lane_order  # noqa: E402
from alphallama.kernels.gemv.registry import (QGEMV_I8, QGEMV_MMA_K, QGEMV_Q8K, QMATMUL, MmaChoice,  # noqa: E402
                                              PlanError, plan_linear)


def _weight(qtype: T, N: int, K: int, seed: int = 0) -> QuantWeight:
    """Random bytes of a valid block layout (the scales as f16 values of moderate size)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N, K // block * size), dtype=np.uint8)
    if qtype == T.F16:
        raw = rng.standard_normal((N, K)).astype(np.float16).view(np.uint8)
    elif qtype == T.Q4_K:   # d, dmin: small positive f16 at the start of every 144-byte block
        r = raw.reshape(N, -1, size)
        r[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.001], dtype=np.float16).tobytes(), dtype=np.uint8)
    return QuantWeight.from_raw(torch.from_numpy(raw), qtype, (N, K), "cpu")


def test_entries_say_which_weights_they_take():
    f16, q4k, q6k = _weight(T.F16, 32, 256), _weight(T.Q4_K, 32, 512), _weight(T.Q6_K, 32, 256)
    assert QMATMUL.supports(f16) is None and QMATMUL.supports(q6k) is None
    assert "no int8 form" in QGEMV_I8.supports(f16)
    assert QGEMV_I8.supports(q4k) is None and QGEMV_I8.supports(q6k) is None
    assert "Q4_K only" in QGEMV_MMA_K.supports(q6k)
    assert QGEMV_MMA_K.supports(q4k) is None and QGEMV_Q8K.family == QGEMV_MMA_K.family
    assert {k.layout for k in (QMATMUL, QGEMV_I8, QGEMV_MMA_K)} == {"f32", "i8", "q8k"}


def test_default_plan_is_one_kernel_at_every_width():
    q4k, f16 = _weight(T.Q4_K, 32, 512), _weight(T.F16, 16, 512)
    p = plan_linear([q4k, f16], "i8")
    assert len(p.steps) == 64 and p.i8 == (True, False) and not any(p.mma)
    for W in range(1, 65):
        s = p.at(W)
        assert s.kernels == (QGEMV_I8, QMATMUL) and s.orders == (lane_order(q4k),)
        assert not s.adds and s.runs == 1      # two weights: no epilogue add
    assert plan_linear([q4k], "f32").at(1).kernels == (QMATMUL,)


def test_gemv_mma_plan_changes_kernel_not_family():
    """engine.gemv_mma: qgemv_q8k up to narrow rows, the mma wider: one family (exact)."""
    q4k, q6k = _weight(T.Q4_K, 32, 512), _weight(T.Q6_K, 32, 512)
    p = plan_linear([q4k, q6k], "i8", mma=MmaChoice(narrow=2))
    assert p.mma == (True, False) and not p.hybrid
    assert p.at(2).kernels == (QGEMV_Q8K, QGEMV_I8) and p.at(3).kernels == (QGEMV_MMA_K, QGEMV_I8)
    assert p.at(1).orders == (Q8K, lane_order(q6k))
    assert p.families(0) == {"q8k"} and p.families(1) == {"i8"}
    p.check_exact()


def test_exact_mode_refuses_a_plan_that_mixes_families():
    """Fast mode's hybrid changes a weight's family with W (dp4a narrow, the mma wide): its
    plan is made, but not as an exact one; a split weight's runs are part of its family."""
    q4k = _weight(T.Q4_K, 32, 512)
    hybrid = MmaChoice(narrow=4, partner="dp4a")
    p = plan_linear([q4k], "i8", split=True, mma=hybrid)
    assert p.hybrid and p.at(4).kernels == (QGEMV_I8,) and p.at(5).kernels == (QGEMV_MMA_K,)
    assert p.at(4).adds and not p.at(5).adds
    assert p.families(0) == {"i8", "q8k"}
    with pytest.raises(PlanError, match="bits families"):
        p.check_exact()
    with pytest.raises(PlanError, match="weight 0"):
        plan_linear([q4k], "i8", mma=hybrid, exact=True)


def test_split_runs_are_planned_with_the_epilogue_add():
    w = _weight(T.Q6_K, 32, 4096)                # rows of 4096 values in a short matrix: 2 runs
    p = plan_linear([w], "i8", split=True)
    assert all(s.adds and s.runs == 2 for s in p.steps)
    assert p.families(0) == {"i8/runs=2"}
    assert all(s.runs == 1 for s in plan_linear([w], "i8").steps)


def test_bad_choices_are_refused():
    w = _weight(T.Q4_K, 32, 512)
    with pytest.raises(ValueError, match="gemv"):
        plan_linear([w], "int4")
    with pytest.raises(ValueError, match="partner"):
        MmaChoice(4, "tensor")

"""moe_i8 (routed experts on int8 activations): gate_up against float64 of the same
int8 input, down against float64 of its own int8 activations, row invariance (a row's
bits whatever W and its column) and tier invariance (an expert read from a bank slot
gives the bits it gives from the host planes). CPU: the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.moe.expert_q8 import quantize_q8  # noqa: E402
from alphallama.kernels.moe.moe_i8 import moe_down_i8, moe_gate_up_i8, moe_i8_order
from alphallama.kernels.gemv.qmatvec_i8 import prepare_i8  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402
from tests.kernels.test_qmatmul import random_raw  # noqa: E402
from tests.kernels.test_qmatvec_i8 import _x, assert_same_bits  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, F, D, K = 5, 256, 256, 256


def _experts(qtype, n, k, seed):
    return QuantWeight.from_raw(random_raw(qtype, E * n, k, seed), qtype, (E, n, k), DEV)


def _q8_float64(x):
    xq, dx, _ = quantize_q8(x.cpu().float())
    return (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)


def _setup(W=3):
    gate_up, down = _experts(T.Q4_K, 2 * F, K, 1), _experts(T.Q6_K, D, F, 2)
    x = _x(W, K, seed=3)
    experts = torch.tensor([[0, 3], [2, 0], [4, 1]][:W], dtype=torch.int32, device=DEV)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]][:W], device=DEV)
    return gate_up, down, x, experts, weights


def test_gate_up_and_down_match_float64():
    gate_up, down, x, experts, weights = _setup()
    q8 = prepare_i8(x, gate_up.expert(0))
    act = moe_gate_up_i8(q8, gate_up, experts, torch.float32)                 # [W, k, F]
    xd = _q8_float64(x)                                                       # [W, K]
    gu = gate_up.dequantize().double().cpu()[experts.long().cpu()]            # [W, k, 2F, K]
    y = torch.einsum("wk,wjnk->wjn", xd, gu)
    ref = torch.nn.functional.silu(y[..., :F]) * y[..., F:]
    scale = torch.einsum("wk,wjnk->wjn", xd.abs(), gu.abs())
    assert ((act.cpu().double() - ref).abs() <= 1e-5 * (scale[..., :F] * scale[..., F:] + scale[..., F:])).all()
    out = moe_down_i8(act, down, experts, weights)                            # [W, D]
    ad = _q8_float64(act.reshape(-1, F)).reshape(act.shape)                   # the kernel's own int8 act
    dw = down.dequantize().double().cpu()[experts.long().cpu()]               # [W, k, D, F]
    ref = (torch.einsum("wjf,wjdf->wjd", ad, dw) * weights.cpu().double()[..., None]).sum(1)
    bound = (torch.einsum("wjf,wjdf->wjd", ad.abs(), dw.abs()) * weights.cpu().double()[..., None]).sum(1)
    assert ((out.cpu().double() - ref).abs() <= 1e-5 * bound + 1e-30).all()


def test_rows_are_invariant_and_tiers_agree():
    gate_up, down, x, experts, weights = _setup()
    def run(x, ex, w, table=None, bank_gu=None, bank_dn=None, gu=gate_up, dn=down):
        q8 = prepare_i8(x, gu.expert(0))
        return moe_down_i8(moe_gate_up_i8(q8, gu, ex, torch.float32, table, bank_gu), dn, ex, w, table, bank_dn)
    full = run(x, experts, weights)
    for r in range(3):                                                        # each row alone
        assert_same_bits(run(x[r:r + 1], experts[r:r + 1], weights[r:r + 1])[0:1], full[r:r + 1], f"row {r}")
    rows = torch.tensor([2, 0])                                               # another width, other columns
    assert_same_bits(run(x[rows], experts[rows.to(DEV)], weights[rows.to(DEV)]), full[rows], "rows 2, 0")
    # experts 0 and 4 in a bank (slots 1 and 0), their host copies zeroed: same bits
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)
    (hgu, bgu), (hdn, bdn) = _split(gate_up, [4, 0]), _split(down, [4, 0])
    assert_same_bits(run(x, experts, weights, table, bgu, bdn, hgu, hdn), full, "bank/host tiers")


def _split(w, slots):
    """(host copy with the experts `slots` lists zeroed, bank holding them in that order)."""
    bank = QuantWeight(w.qtype, (len(slots), *w.shape[1:]), {n: p[slots].clone() for n, p in w.planes.items()})
    host = {n: p.clone() for n, p in w.planes.items()}
    for p in host.values():
        p[slots] = 0
    return QuantWeight(w.qtype, w.shape, host), bank


def test_paired_gate_up_keeps_the_bits():
    """gate_up walking K once for gate and up rows together (moe_i8.GATE_UP_PAIRED, the
    default) gives the bits of two walks, from the host planes and from a bank slot."""
    gate_up, _, x, experts, _ = _setup()
    q8 = prepare_i8(x, gate_up.expert(0))
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)
    hgu, bgu = _split(gate_up, [4, 0])
    want = moe_gate_up_i8(q8, gate_up, experts, torch.float32, paired=False)
    want_tiers = moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu, paired=False)
    assert_same_bits(moe_gate_up_i8(q8, gate_up, experts, torch.float32, paired=True), want, "paired")
    assert_same_bits(moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu, paired=True), want_tiers,
                     "paired, tiers")


def test_contract_form_is_the_expert_contract():
    """CONTRACT: each pair's activation and down part are expert_q8's (matvec_q8, silu_mul_c,
    quantize_q8) bit for bit, paired walk or not, from a bank slot or the host planes; a
    pair of the skipped tier is neither computed nor written."""
    from alphallama.kernels.moe.expert_q8 import matvec_q8, silu_mul_c
    gate_up, down, x, experts, weights = _setup()
    q8 = prepare_i8(x, gate_up.expert(0))
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)
    (hgu, bgu), (hdn, bdn) = _split(gate_up, [4, 0]), _split(down, [4, 0])
    xq, dx, xs = quantize_q8(x.cpu().float())
    cpu = lambda w: QuantWeight(w.qtype, w.shape, {n: t.cpu() for n, t in w.planes.items()})   # noqa: E731
    gu_c, dn_c = cpu(gate_up), cpu(down)
    W, k = experts.shape
    want_act = torch.stack([torch.stack([silu_mul_c(*matvec_q8(xq[m], dx[m], xs[m], gu_c.expert(int(e))).split(F))
                                         for e in experts[m].tolist()]) for m in range(W)])   # [W, k, F]
    for paired in (False, True):
        act = moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu, paired=paired, contract=True)
        assert_same_bits(act, want_act, f"gate_up, paired={paired}")
    aq, adx, axs = quantize_q8(want_act.reshape(W * k, F))
    want_part = torch.stack([matvec_q8(aq[i], adx[i], axs[i], dn_c.expert(int(experts.flatten()[i])))
                             for i in range(W * k)]).reshape(W, k, D)
    part, _ = moe_down_i8(act, hdn, experts, weights, table, bdn, combine=False, contract=True)
    assert_same_bits(part, want_part, "down parts")
    tier = torch.tensor([[0, 2], [2, 1], [0, 0]], dtype=torch.int32, device=DEV)   # pairs (0, 1), (1, 0): the CPU's
    act = moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu, contract=True, skip=(tier, 2))
    part, _ = moe_down_i8(act, hdn, experts, weights, table, bdn, combine=False, contract=True, skip=(tier, 2))
    mine = (tier != 2).cpu()
    assert_same_bits(act.cpu()[mine], want_act[mine], "gate_up, the GPU's pairs")
    assert_same_bits(part.cpu()[mine], want_part[mine], "down, the GPU's pairs")
    with pytest.raises(ValueError, match="float32"):
        moe_gate_up_i8(q8, gate_up, experts, torch.bfloat16, contract=True)


def test_order_is_the_gate_up_weights():
    gate_up, *_ = _setup()
    assert moe_i8_order(gate_up) == (32, 4, 4)


def _sm90_args(qtype, K, kern, table):
    """(types, constexprs) of one of the kernels on a [8, 64, K] weight, for sm90.compile_sm90."""
    from alphallama.kernels.moe import moe_i8
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8", torch.uint8: "*u8"}
    f = FORMATS[qtype]
    packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
    planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES] * 2
    w = QuantWeight(qtype, (8, 64, K), {"qs": torch.zeros(8, 64, K // f.slot * f.V, dtype=torch.int32)})
    gate_up = kern is moe_i8._gate_up_i8_kernel
    const = {**moe_i8.expert_consts(w, 64, True), "TABLE": table, **({"TOP_K": 8} if gate_up else {})}
    types = ["*i32", "*i32", "*bf16" if gate_up else "*fp32", "*i32", "*i32", *planes, "i32", "i32"]
    return types, const


def compile_sm90() -> None:
    """Both kernels for sm_90, with and without the expert table (child process)."""
    from alphallama.kernels.moe import moe_i8
    from tests.kernels.sm90 import compile_sm90 as build

    for qtype, K, kern in ((T.Q4_K, 2048, moe_i8._gate_up_i8_kernel), (T.Q6_K, 768, moe_i8._down_i8_kernel)):
        for table in (False, True):
            build(kern, *_sm90_args(qtype, K, kern, table))
    for table in (False, True):      # gate_up walking gate and up rows together
        types, const = _sm90_args(T.Q4_K, 2048, moe_i8._gate_up_i8_kernel, table)
        build(moe_i8._gate_up_i8_kernel, types, {**const, "PAIRED": True})


def test_compiles_for_sm90():
    run_in_child("test_moe_i8")

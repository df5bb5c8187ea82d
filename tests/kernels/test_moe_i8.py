"""moe_i8 (routed experts on int8 activations): gate_up against float64 of the same
int8 input, down against float64 of its own int8 activations, row invariance (a row's
bits whatever W and its column) and tier invariance (an expert read from a bank slot
gives the bits it gives from the host planes), the one-launch down (counters: the last
program of a row's block combines it) against the two-launch one, bit for bit. CPU: the
Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels import QuantWeight  # noqa: E402
from alphallama.kernels.expert_q8 import quantize_q8  # noqa: E402
from alphallama.kernels.moe import _combine_block, _down_combine_kernel  # noqa: E402
from alphallama.kernels.moe_i8 import (  # noqa: E402
    moe_down_i8,
    moe_down_i8_counters,
    moe_gate_up_i8,
    moe_gate_up_i8_q8,
    moe_i8_order,
)
from alphallama.kernels.qmatvec_i8 import lane_order, prepare_i8  # noqa: E402
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


@pytest.mark.parametrize("Dn", [D, 200])                                      # 200: a part-filled last block
def test_fused_combine_is_bit_identical(Dn, monkeypatch):
    """counters= (one launch) against the two-launch path: the same bits for several W
    and top-k, rows whose experts repeat, from the resident weights and through a
    bank/host table; the counters are back to 0 after each call, and a second call on
    them gives the same bits again. Fresh buffers are all ones bits (float NaN), so a
    combine that read a part before it was written could not pass on the memory of the
    last call's parts."""
    empty = torch.empty
    def poisoned(*a, **kw):
        t = empty(*a, **kw)
        t.view(torch.uint8).fill_(0xFF)
        return t
    monkeypatch.setattr(torch, "empty", poisoned)
    down = _experts(T.Q6_K, Dn, F, 2)
    hdn, bdn = _split(down, [4, 0])
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)  # experts 4, 0 in the bank
    g = torch.Generator().manual_seed(7)
    for W, k in ((1, 1), (3, 2), (2, 4)):
        act = (torch.randn(W, k, F, generator=g) * 3).to(DEV)                # [W, k, F]
        experts = torch.randint(0, E, (W, k), generator=g, dtype=torch.int32)
        experts[-1, 0] = 4                                                    # a bank expert, whatever the draw
        experts[0, -1] = experts[0, 0]                                        # row 0: an expert twice (k = 1: once)
        experts = experts.to(DEV)                                             # [W, k]
        weights = torch.softmax(torch.randn(W, k, generator=g), -1).to(DEV)   # [W, k]
        counters = moe_down_i8_counters(down, W + 2, DEV)                     # larger than W needs
        for tier, args in (("resident", ()), ("bank/host", (table, bdn))):
            w = (hdn,) if args else (down,)
            ref = moe_down_i8(act, *w, experts, weights, *args)
            for call in range(2):
                got = moe_down_i8(act, *w, experts, weights, *args, counters=counters)
                assert_same_bits(got, ref, f"D {Dn} W {W} k {k} {tier} call {call}")
                assert not counters.any(), f"counters left {counters.tolist()}"
            if args:
                assert_same_bits(ref, moe_down_i8(act, down, experts, weights), f"D {Dn} W {W} k {k} tiers")


@triton.jit
def _combine_probe(part, weights, out, N, TOP_K: tl.constexpr, BD: tl.constexpr):
    """moe._down_combine_kernel's grid and stores around _combine_block as the one-launch
    down calls it (parts loaded through L2)."""
    n_db = tl.cdiv(N, BD)
    m = (tl.program_id(0) // n_db).to(tl.int64)
    n = (tl.program_id(0) % n_db) * BD + tl.arange(0, BD)                     # [BD]
    tl.store(out + m * N + n, _combine_block(part, weights, m, n, N, TOP_K, ".cg"), mask=n < N)


def test_combine_block_is_moe_combine():
    """The fused path's combine helper against moe.py's combine kernel (the two-launch
    path's), with signed zeros, subnormals and large values, at the kernel's block and
    at another block size (the fused path combines the down kernel's block)."""
    W, k, N = 3, 5, 300
    g = torch.Generator().manual_seed(11)
    part = torch.randn(W, k, N, generator=g) * torch.logspace(-30, 30, N)     # [W, k, N]
    part[:, :, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e37, -1e37, 1.0, -1.0])
    weights = torch.rand(W, k, generator=g)                                   # [W, k]
    weights[0, 1] = 0.0
    part, weights = part.to(DEV), weights.to(DEV)
    ref = torch.empty(W, N, device=DEV)                                       # [W, N]
    _down_combine_kernel[(W * triton.cdiv(N, 256),)](part, weights, ref, N, TOP_K=k, BD=256, num_warps=2,
                                                     enable_fp_fusion=False)
    for BD in (256, 64):
        got = torch.empty(W, N, device=DEV)                                   # [W, N]
        _combine_probe[(W * triton.cdiv(N, BD),)](part, weights, got, N, TOP_K=k, BD=BD, num_warps=2,
                                                  enable_fp_fusion=False)
        assert_same_bits(got, ref, f"BD {BD}")


def test_fused_combine_checks_counters():
    down = _experts(T.Q6_K, D, F, 2)
    act = torch.zeros(2, 2, F, device=DEV)                                    # [W, k, F]
    experts = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    weights = torch.full((2, 2), 0.5, device=DEV)
    need = moe_down_i8_counters(down, 2, DEV)
    spaced = torch.zeros(2 * need.numel(), dtype=torch.int32, device=DEV)[::2]   # enough, not contiguous
    for bad in (need.long(), need.flatten()[:-1], spaced):
        with pytest.raises(ValueError, match="counters"):
            moe_down_i8(act, down, experts, weights, counters=bad)


def test_paired_gate_up_keeps_the_bits(monkeypatch):
    """gate_up walking K once for gate and up rows together (moe_i8.GATE_UP_PAIRED, the
    default) gives the bits of two walks, from the host planes and from a bank slot."""
    from alphallama.kernels import moe_i8
    gate_up, _, x, experts, _ = _setup()
    q8 = prepare_i8(x, gate_up.expert(0))
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)
    hgu, bgu = _split(gate_up, [4, 0])
    monkeypatch.setattr(moe_i8, "GATE_UP_PAIRED", False)
    want = moe_gate_up_i8(q8, gate_up, experts, torch.float32)
    want_tiers = moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu)
    monkeypatch.setattr(moe_i8, "GATE_UP_PAIRED", True)
    assert_same_bits(moe_gate_up_i8(q8, gate_up, experts, torch.float32), want, "paired")
    assert_same_bits(moe_gate_up_i8(q8, hgu, experts, torch.float32, table, bgu), want_tiers, "paired, tiers")


@pytest.mark.parametrize("f", [F, 96], ids=["F256", "F96"])      # 96: a part-filled last program on the CPU
def test_gate_up_emits_the_down_input(f):
    """moe_gate_up_i8_q8: the act's int8 activations made in gate_up's launch are bit for
    bit prepare_i8 of the act it returns (the down's lane order, from host planes and from
    a bank slot); the down given them gives the bits of the down that prepares them; on
    the CPU the act itself is moe_gate_up_i8's (the same tile there)."""
    gate_up = _experts(T.Q4_K, 2 * f, K, 31)
    down = QuantWeight.from_raw(random_raw(T.Q6_K, E * D, f + 160 if f % 256 else f, 32), T.Q6_K,
                                (E, D, f + 160 if f % 256 else f), DEV)       # only its lane order is used below
    _, _, x, experts, weights = _setup()
    q8 = prepare_i8(x, gate_up.expert(0))
    order = lane_order(down.expert(0))
    table = torch.tensor([1, -1, -1, -1, 0], dtype=torch.int32, device=DEV)
    hgu, bgu = _split(gate_up, [4, 0])
    for args in ((), (table, bgu)):
        gu = hgu if args else gate_up
        act, (xp, xsd) = moe_gate_up_i8_q8(q8, gu, experts, torch.float32, order, *args)
        want_xp, want_xsd = prepare_i8(act.reshape(-1, f), down.expert(0))
        assert torch.equal(xp, want_xp) and torch.equal(xsd, want_xsd)
        if DEV == "cpu":
            assert_same_bits(act, moe_gate_up_i8(q8, gu, experts, torch.float32, *args), "act")
    if f == F:                                                                 # a down of this width: K = F
        _, dn, *_ = _setup()
        act, aq = moe_gate_up_i8_q8(q8, gate_up, experts, torch.float32, lane_order(dn.expert(0)))
        assert_same_bits(moe_down_i8(act, dn, experts, weights, prepared=aq), moe_down_i8(act, dn, experts, weights),
                         "down given the emitted input")


def test_order_is_the_gate_up_weights():
    gate_up, *_ = _setup()
    assert moe_i8_order(gate_up) == (32, 4, 4)


def _sm90_args(qtype, K, kern, table, fused=False):
    """(types, constexprs) of one of the kernels on a [8, 64, K] weight, for sm90.compile_sm90."""
    from alphallama.kernels import moe_i8
    from alphallama.kernels.formats import PLANES
    from alphallama.kernels.qweight import FORMATS

    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}
    f = FORMATS[qtype]
    packed = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
    planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES] * 2
    w = QuantWeight(qtype, (8, 64, K), {"qs": torch.zeros(8, 64, K // f.slot * f.V, dtype=torch.int32)})
    gate_up = kern is moe_i8._gate_up_i8_kernel
    const = {**moe_i8._consts(w, 64, True), "TABLE": table, **({"TOP_K": 8} if gate_up or fused else {})}
    types = ["*i32", "*i32", "*bf16" if gate_up else "*fp32", "*i32", "*i32", *planes, "i32", "i32"]
    if fused:
        const["COMBINE"] = True
        types += ["*fp32", "*fp32", "*i32"]                                   # weights, out, counters
    return types, const


def compile_sm90() -> None:
    """Both kernels for sm_90, with and without the expert table (child process)."""
    from alphallama.kernels import moe_i8
    from tests.kernels.sm90 import compile_sm90 as build

    for qtype, K, kern in ((T.Q4_K, 2048, moe_i8._gate_up_i8_kernel), (T.Q6_K, 768, moe_i8._down_i8_kernel)):
        for table in (False, True):
            build(kern, *_sm90_args(qtype, K, kern, table))
    for table in (False, True):      # gate_up emitting the down's int8 input (32-row programs)
        types, const = _sm90_args(T.Q4_K, 2048, moe_i8._gate_up_i8_kernel, table)
        build(moe_i8._gate_up_i8_kernel, types + ["*i8", "*i32"],
              {**const, "BN": 32, "PDL": True,
               "PAIRED": True, "FQ": 768, "SLOT1": 16, "V1": 2, "BITS1": 4, "EMIT": True})
    for table in (False, True):      # gate_up walking gate and up rows together
        types, const = _sm90_args(T.Q4_K, 2048, moe_i8._gate_up_i8_kernel, table)
        build(moe_i8._gate_up_i8_kernel, types, {**const, "PAIRED": True})


def compile_sm90_fused() -> None:
    """The one-launch down (COMBINE, TOP_K 8) for sm_90, with and without the table
    (child process), and what its PTX does: the part stores, a CTA barrier, then one
    thread's acquire-release gpu-scope add on the counter, its result broadcast through
    shared memory; the last arrival's 8 part loads go through L2 (.cg)."""
    import re

    from alphallama.kernels import moe_i8
    from tests.kernels.sm90 import compile_sm90 as build

    for table in (False, True):
        ptx = build(moe_i8._down_i8_kernel, *_sm90_args(T.Q6_K, 768, moe_i8._down_i8_kernel, table, True)).asm["ptx"]
        atoms = re.findall(r"@%p\d+ atom\.global\.gpu\.acq_rel\.add\.u32 (%r\d+), \[ %rd\d+ \+ 0 \], %r\d+;", ptx)
        assert len(atoms) == 1 and ptx.count("atom.") == 1, re.findall(r".*atom\..*", ptx)
        at = ptx.index("atom.global")
        assert ptx.index("st.global") < ptx.rindex("bar.sync", 0, at), "no barrier between the part stores and the add"
        assert re.search(rf"st\.shared\.b32 \[ %r\d+ \+ 0 \], {re.escape(atoms[0])};\s*// end inline asm\s*bar\.sync",
                         ptx[at:]), "the add's result is not broadcast"
        assert len(re.findall(r"ld\.global\.cg\.b32", ptx[at:])) == 8, "the parts are not loaded through L2"
        assert "ld.global.cg" not in ptx[:at] and "fence" not in ptx


def test_compiles_for_sm90():
    run_in_child("test_moe_i8")


def test_fused_compiles_for_sm90():
    run_in_child("test_moe_i8", "compile_sm90_fused")

"""kernels/moe/moe_f32.py's down projection, split into (row, rank, n block) programs and a rank
sum, gives the bits of the kernel it replaced (one program per (row, n block) walking the
ranks), kept here as the reference: resident, through an expert table (bank slots and
host tier mixed), ragged D, every rows_per_thread the runtime uses; and a row's bits do
not depend on W or its column. On a GPU this compares two compiled kernels, so it also
checks that the compiler reduces the split kernel's tile in the same order."""
from __future__ import annotations


import pytest
import torch


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf.quants import QUANTS  # noqa: E402
from alphallama.kernels.moe.moe_f32 import NUM_WARPS, _acc_row, bank_args, moe_down, moe_down_ref  # noqa: E402
from alphallama.kernels.moe.route import moe_route  # noqa: E402
from alphallama.kernels.gemv.qmatmul import tile  # noqa: E402
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit(do_not_specialize=["one"])
def _down_v1_kernel(act, out, weights, experts, table, qs, qh, sc, sd, bqs, bqh, bsc, bsd, N, one,
                    TOP_K: tl.constexpr, TABLE: tl.constexpr, n_slots: tl.constexpr, LOAD: tl.constexpr,
                    FIELD: tl.constexpr, V: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr):
    """The replaced kernel, as it was (commit ef8fd6c): program (row, n block), its TOP_K
    experts in ascending rank, y = fma(partial_r, weight_r, y)."""
    n_nb = tl.cdiv(N, BN)
    m = (tl.program_id(0) // n_nb).to(tl.int64)
    n_out = (tl.program_id(0) % n_nb) * BN + tl.arange(0, BN)  # [BN]
    nn = tl.minimum(n_out, N - 1)[None, :]   # [1, BN]
    K: tl.constexpr = n_slots * V * P
    y = tl.zeros([BN], tl.float32)
    for r in tl.static_range(TOP_K):
        e = tl.load(experts + m * TOP_K + r).to(tl.int64)
        wr = tl.load(weights + m * TOP_K + r)
        a_row = act + (m * TOP_K + r) * K
        if TABLE:
            slot = tl.load(table + e).to(tl.int64)
            if slot >= 0:
                acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, bqs, bqh, bsc, bsd, slot * N + nn, one,
                               n_slots, LOAD, FIELD, V, P, NT)
            else:
                acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, qs, qh, sc, sd, e * N + nn, one,
                               n_slots, LOAD, FIELD, V, P, NT)
        else:
            acc = _acc_row(tl.zeros([NT, BN, V], tl.float32), a_row, qs, qh, sc, sd, e * N + nn, one,
                           n_slots, LOAD, FIELD, V, P, NT)
        y = tl.fma(tl.sum(tl.sum(acc, axis=2), axis=0), wr, y)
    tl.store(out + m * N + n_out, y, mask=n_out < N)


def down_v1(act, down, experts, weights, rows_per_thread, table=None, bank=None) -> torch.Tensor:
    W, k, _ = act.shape
    D = down.N
    out = torch.empty((W, D), dtype=torch.float32, device=act.device)  # [W, D]
    BN, NT, num_warps = tile(down, rows_per_thread, num_warps=NUM_WARPS)
    fmt = down.fmt
    _down_v1_kernel[(W * triton.cdiv(D, BN),)](
        act.contiguous(), out, weights.float().contiguous(), experts.contiguous(),
        *bank_args(down, table, bank), D, 1, TOP_K=k, TABLE=table is not None, n_slots=down.n_slots,
        LOAD=fmt.triton_load, FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, BN=BN, NT=NT, num_warps=num_warps,
        enable_fp_fusion=False)
    return out


def expert_weight(qtype: T, shape: tuple[int, int, int], seed: int) -> QuantWeight:
    """Random GGUF bits for an [E, N, K] tensor, every fp16 scale a small finite value."""
    g = torch.Generator().manual_seed(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    nb = shape[0] * shape[1] * shape[2] // block
    blocks = torch.randint(0, 256, (nb, size), dtype=torch.uint8, generator=g)  # [nb, size]
    for off in QUANTS[qtype].f16_fields:
        scale = (torch.rand(nb, generator=g) * 2 - 1) * 2e-3  # [nb]
        blocks[:, off:off + 2] = scale.to(torch.float16).reshape(nb, 1).view(torch.uint8)
    return QuantWeight.from_raw(blocks, qtype, shape, DEV)


def inputs(W: int, E: int, k: int, F: int, seed: int, act_dtype=torch.float32):
    """(act [W, k, F], weights [W, k], experts [W, k] int32): routed from random logits;
    one rank weight is exactly 0 (its product still enters the FMA chain)."""
    g = torch.Generator().manual_seed(seed)
    act = torch.randn(W, k, F, generator=g).to(act_dtype).to(DEV)   # [W, k, F]
    weights, experts = moe_route(torch.randn(W, E, generator=g).to(DEV), k, True)  # [W, k] each
    weights[0, k - 1] = 0.0
    return act, weights, experts


@pytest.mark.parametrize("qtype,rpt", [(T.Q4_K, 4), (T.Q6_K, 4), (T.Q8_0, 2)], ids=["Q4_K-4", "Q6_K-4", "Q8_0-2"])
def test_down_bits_equal_the_replaced_kernel(qtype, rpt):
    E, D, F, W, k = 5, 40, 256, 3, 3          # D not a multiple of BN: masked rows
    down = expert_weight(qtype, (E, D, F), seed=1)
    act, weights, experts = inputs(W, E, k, F, seed=2, act_dtype=torch.bfloat16)
    new, old = moe_down(act, down, experts, weights, rpt), down_v1(act, down, experts, weights, rpt)
    assert torch.equal(new, old)
    cpu = QuantWeight(down.qtype, down.shape, {n: p.cpu() for n, p in down.planes.items()})
    ref = moe_down_ref(act.cpu(), cpu, experts.cpu(), weights.cpu())   # and it is the right function
    torch.testing.assert_close(new.cpu(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_down_through_a_table_same_bits_whichever_tier():
    """Experts 0, 2 in bank slots, the rest on the host tier: the same bits as the
    replaced kernel through the same table, and as the all-resident call."""
    E, D, F, W, k = 4, 24, 256, 2, 3
    down = expert_weight(T.Q6_K, (E, D, F), seed=3)
    table = torch.tensor([1, -1, 0, -1], dtype=torch.int32, device=DEV)   # [E] -> slot
    bank = QuantWeight(down.qtype, (2, D, F), {n: p[[2, 0]].clone() for n, p in down.planes.items()})
    host = QuantWeight(down.qtype, down.shape, {n: p.clone() for n, p in down.planes.items()})
    for p in host.planes.values():
        p[[0, 2]] = 0   # the host copy of a banked expert is never read
    act, weights, experts = inputs(W, E, k, F, seed=4)
    new = moe_down(act, host, experts, weights, 4, table, bank)
    assert torch.equal(new, down_v1(act, host, experts, weights, 4, table, bank))
    assert torch.equal(new, moe_down(act, down, experts, weights, 4))


def test_down_rows_invariant_to_width_and_column():
    E, D, F, W, k = 4, 20, 256, 5, 2
    down = expert_weight(T.Q4_K, (E, D, F), seed=5)
    act, weights, experts = inputs(W, E, k, F, seed=6)
    full = moe_down(act, down, experts, weights, 4)                      # [W, D]
    rot = torch.roll(torch.arange(W), 2)                                 # every row in another column
    assert torch.equal(moe_down(act[rot], down, experts[rot], weights[rot], 4), full[rot])
    for i in (0, W - 1):
        assert torch.equal(moe_down(act[i:i + 1], down, experts[i:i + 1], weights[i:i + 1], 4), full[i:i + 1])

"""kernels/moe/moe_gemm.py: the grouped expert GEMMs of MoE prefill (dequantizing on the fly)
against a float64 reference built from the weights' own plain-torch dequantization;
moe_align's padded blocks against a hand-built routing."""
from __future__ import annotations


import pytest
import torch


from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.moe.moe_gemm import block_rows, moe_align, moe_prefill  # noqa: E402
from alphallama.kernels.formats.qweight import QuantWeight  # noqa: E402
try:                                                           # pytest puts tests/kernels on the path
    from test_qmatmul import random_raw  # noqa: E402
except ImportError:                                            # sm90.run_in_child imports from the root
    from tests.kernels.test_qmatmul import random_raw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(qtype, E, N, K, seed):
    return QuantWeight.from_raw(random_raw(qtype, E * N, K, seed), qtype, (E, N, K), DEV)


def _reference(h, weights, experts, gu, dn):
    """float64: silu(h Wg^T) * (h Wu^T) through down, summed over the ranks by weight."""
    Wgu, Wdn = gu.dequantize().double().cpu(), dn.dequantize().double().cpu()   # [E, 2F, D], [E, D, F]
    F = Wdn.shape[-1]
    x = h.double().cpu()
    out = torch.zeros(x.shape[0], Wdn.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for r in range(experts.shape[1]):
            e = int(experts[t, r])
            gu_t = Wgu[e] @ x[t]                                               # [2F]
            act = torch.nn.functional.silu(gu_t[:F]) * gu_t[F:]
            out[t] += float(weights[t, r]) * (Wdn[e] @ act)
    return out


def test_moe_align_blocks():
    # 3 experts, BM 4: expert 0 takes pairs 1, 2; expert 2 takes 0, 3, 4, 5, 6 (two blocks); expert 1 none
    experts = torch.tensor([2, 0, 0, 2, 2, 2, 2, 1]).view(4, 2)                 # pair p = row * 2 + rank
    slot_pair, block_expert, total = moe_align(experts, 3, 4)
    P = 8
    # expert 0: pairs 1, 2 + 2 pads; expert 1: pair 7 + 3 pads; expert 2: 0, 3, 4, 5 | 6 + 3 pads
    assert slot_pair.tolist()[:16] == [1, 2, P, P, 7, P, P, P, 0, 3, 4, 5, 6, P, P, P]
    assert int(total) == 16
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]
    assert slot_pair.shape[0] == (2 + 3) * 4 and (slot_pair[16:] == P).all()   # cdiv(8, 4) + 3 blocks


def test_block_rows():
    assert block_rows(4096, 128) == 32 and block_rows(40, 8) == 16 and block_rows(1 << 16, 128) == 64


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.F16], ids=lambda q: q.name)
def test_moe_prefill_matches_float64(qtype):
    E, F, D, Tn, k = 6, 256, 256, 21, 2
    gu, dn = _weight(qtype, E, 2 * F, D, 1), _weight(qtype, E, D, F, 2)
    g = torch.Generator().manual_seed(3)
    experts = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(Tn)]).int()  # expert 5 unused
    experts[:9, 0] = 2                                                         # one expert over two blocks
    experts[:9, 1] = torch.where(experts[:9, 1] == 2, 0, experts[:9, 1])
    weights = torch.rand(Tn, k, generator=g)
    h = torch.randn(Tn, D, generator=g)
    out = moe_prefill(h.to(DEV), weights.to(DEV), experts.to(DEV), gu, dn, tile=(32, 4, 2))
    ref = _reference(h, weights, experts, gu, dn)
    assert out.dtype == torch.float32 and out.shape == (Tn, D)
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err


def test_moe_prefill_shape_check():
    gu, dn = _weight(T.Q8_0, 4, 64, 64, 1), _weight(T.Q8_0, 4, 64, 64, 2)       # down should be [4, 64, 32]
    with pytest.raises(ValueError, match="do not agree"):
        moe_prefill(torch.zeros(3, 64, device=DEV), torch.ones(3, 1, device=DEV),
                    torch.zeros(3, 1, dtype=torch.int32, device=DEV), gu, dn)


def compile_sm90() -> None:
    """The grouped GEMM for sm_90 in bf16: gated Q4_K gate|up, Q6_K and Q8_0 down."""
    from alphallama.kernels.moe import moe_gemm
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as build

    planes = {T.Q4_K: ["*i32", "*i32", "*i16", "*fp16"], T.Q6_K: ["*i32", "*i32", "*i8", "*fp16"],
              T.Q8_0: ["*i32", "*i32", "*fp16", "*i32"]}
    for qtype, gated, K in ((T.Q4_K, True, 2048), (T.Q6_K, False, 768), (T.Q8_0, False, 768)):
        fmt = FORMATS[qtype]
        out = "*bf16" if gated else "*fp32"
        build(moe_gemm._moe_gemm_kernel,
              ["*bf16", out, "*i32", "*i32", "*i32", *planes[qtype], "i32", "i32", "i32", "i32", "i32", "i32"],
              dict(TOP_K=8, GATHER=gated, GATED=gated, PREC="tf32", n_slots=K // fmt.slot, LOAD=fmt.triton_load,
                   FIELD=fmt.triton_field, V=fmt.V, P=fmt.P, BM=32, BN=64, NT=64 // fmt.slot), num_warps=4)


def test_compiles_for_sm90():
    from sm90 import run_in_child
    run_in_child("test_moe_gemm")

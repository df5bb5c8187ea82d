"""Programmatic dependent launch: every decode kernel that takes PDL compiles for sm_90
with it, its PTX carries griddepcontrol.launch_dependents and .wait, and qgemv_i8 asks
for its first weights before the wait (the point of launching early). The launch
arguments are empty off CUDA (the interpreter has no griddepcontrol). Timing and GPU
runs: not yet (config engine.pdl is off)."""
from __future__ import annotations

import torch

from alphallama.kernels.pdl import pdl_kwargs
from tests.kernels.sm90 import run_in_child


def test_no_pdl_off_cuda():
    assert pdl_kwargs(True, torch.device("cpu")) == {}
    assert pdl_kwargs(False, torch.device("cpu")) == {}


def compile_sm90() -> None:
    from gguf.constants import GGMLQuantizationType as T

    from alphallama.kernels.attention import decode as attention
    from alphallama.kernels.norm import rmsnorm
    from alphallama.kernels.activations import silu
    from alphallama.kernels.attention import rope
    from alphallama.kernels.moe import route
    from alphallama.kernels.moe import moe_f32 as moe
    from alphallama.kernels.gemv import qgemv_i8, qmatvec_i8
    from alphallama.kernels.gemv.qmatmul import _qmatmul_kernel, tile as qmatmul_tile
    from alphallama.kernels.moe.expert_q8_gpu import CODES
    from alphallama.kernels.formats.format import PLANES
    from alphallama.kernels.formats.qweight import FORMATS
    from tests.kernels.sm90 import compile_sm90 as compile_kernel

    def build(kern, types, const) -> str:
        ptx = compile_kernel(kern, types, {**const, "PDL": True}).asm["ptx"]
        assert "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx, kern.fn.__name__
        return ptx

    f = FORMATS[T.Q4_K]
    packed = f.pack(torch.zeros((1, 4096 // f.block_size, f.type_size), dtype=torch.uint8))
    ptr = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.int8: "*i8"}
    planes = [ptr[packed.get(n, packed["qs"]).dtype] for n in PLANES]
    bits, hbits, bias, has_min = CODES[T.Q4_K]
    ptx = build(qgemv_i8._qgemv_i8_kernel, ["*i32", "*i32", "*fp32", *planes, "i32", "i32", "i32", "i32"],
                dict(n_slots=128, LOAD=f.triton_load, V=f.V, BITS=bits, HBITS=hbits, BIAS=bias, HAS_MIN=has_min,
                     BN=4, NT=32, BW=1, PREFETCH=True, DP4A=True))
    body = ptx[ptx.index(".entry"):]
    assert body.index("ld.global") < body.index("griddepcontrol.wait"), "weights not fetched before the wait"
    # the MoE router (F32 weights through qmatmul, PDL mode 2: its weights before the wait),
    # the routing and the experts' weighted sum
    fr = FORMATS[T.F32]
    pr = fr.pack(torch.zeros((128, 2048 // fr.block_size, fr.type_size), dtype=torch.uint8))
    rplanes = [{torch.float32: "*fp32", torch.int32: "*i32"}.get(pr.get(n, pr["qs"]).dtype, "*i32") for n in PLANES]
    r_slots = 2048 // fr.slot
    BN, NT, nw = qmatmul_tile(type("W", (), {"n_slots": r_slots})(), 4)
    rptx = compile_kernel(_qmatmul_kernel, ["*bf16", "*fp32", *rplanes, "i32", "i32", "i32", "i32"],
                          dict(n_slots=r_slots, LOAD=fr.triton_load, FIELD=fr.triton_field, V=fr.V, P=fr.P, BN=BN,
                               NT=NT, BW=1, PDL=2)).asm["ptx"]
    body = rptx[rptx.index(".entry"):]
    assert body.index("ld.global") < body.index("griddepcontrol.wait"), "router weights not fetched before the wait"
    build(route._route_kernel, ["*fp32", "*fp32", "*i32", "i32"], dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, NORM=True))
    build(moe.down_combine_kernel, ["*fp32", "*fp32", "*fp32", "i32"], dict(TOP_K=8, BD=moe.BD_COMBINE))
    from alphallama.kernels.moe import moe_i8
    from tests.kernels.test_moe_i8 import _sm90_args
    build(moe_i8._gate_up_i8_kernel, *_sm90_args(T.Q4_K, 2048, moe_i8._gate_up_i8_kernel, True))
    build(moe_i8._down_i8_kernel, *_sm90_args(T.Q6_K, 768, moe_i8._down_i8_kernel, True))
    build(qmatvec_i8._prepare_kernel, ["*bf16", "*i8", "*i32", "i32"], dict(K=4096, BQ=256, SLOT=32, V=4, BITS=4))
    build(rmsnorm._add_rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "*bf16", "fp32", "*i8", "*i32"],
          dict(D=4096, BLOCK=4096, HAS_Y=True, XP2=None, XS2=None, NQ=1, SLOT1=32, V1=4, BITS1=4, SLOT2=32, V2=4,
               BITS2=4))
    build(silu._silu_mul_kernel, ["*fp32", "*bf16", "*i8", "*i32"], dict(F=12288, BLOCK=1024, NQ=1, SLOT1=16, V1=2,
                                                                        BITS1=4))
    build(rope._qkv_rope_kernel, ["*fp32"] * 7 + ["*fp16", "*fp16", "*i32", "fp32"] + ["i32"] * 4,
          dict(N_HEADS=32, N_KV=8, HD=128, HAS_BIAS=False, QK_NORM=True, NEOX=True))
    build(attention._attn_split_kernel, ["*fp32", "*fp16", "*fp16", "*fp32", "*fp32", "*fp32", "*i32", "fp32"]
          + ["i32"] * 9, dict(N_HEADS=32, GROUP=4, G_PAD=16, HD=128, BLOCK_N=attention.BLOCK_N,
                              MAX_SPLITS=attention.MAX_SPLITS))
    from tests.kernels.test_attention_split import combine_q8_sm90
    build(attention._attn_combine_kernel, *combine_q8_sm90())


def test_compiles_for_sm90_with_pdl():
    run_in_child("test_pdl")

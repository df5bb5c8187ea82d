"""The MoE kernels compile for the H200 (sm_90) with and without the expert table.

The Triton interpreter runs what the compiler rejects (a branch whose two sides give a
variable different integer types ran on CPU and failed on the H200), so the kernels
are also compiled here, on the CPU, with the ptxas that ships with Triton: no GPU needed.
The compile (tests/kernels/sm90.py) runs in a child process: this test session imported the
kernels under the interpreter, which replaces @triton.jit functions by interpreted ones."""
from __future__ import annotations

import pytest
import torch
import triton
from gguf.constants import GGMLQuantizationType as T

from alphallama.kernels.moe import moe_f32 as moe
from alphallama.kernels.moe import route
from alphallama.kernels.formats.format import PLANES
from alphallama.kernels.gemv.qmatmul import tile
from alphallama.kernels.formats.qweight import FORMATS, QuantWeight
from tests.kernels.sm90 import compile_sm90, run_in_child

_PTR = {torch.int32: "*i32", torch.int16: "*i16", torch.float16: "*fp16", torch.uint8: "*u8", torch.int8: "*i8",
        torch.float32: "*fp32"}


def _plane_types(qtype: T, K: int) -> list[str]:
    f = FORMATS[qtype]
    p = f.pack(torch.zeros((1, K // f.block_size, f.type_size), dtype=torch.uint8))
    return [_PTR[p.get(n, p["qs"]).dtype] for n in PLANES]


def _compile(kernel, types: list[str], const: dict) -> None:
    """types: the run-time arguments' types in the kernel's order; const: its constexprs."""
    compile_sm90(kernel, types, const, num_warps=moe.NUM_WARPS)


def compile_all(table: bool) -> None:
    for qtype, kind, K in ((T.Q4_K, "gate_up", 2048), (T.Q6_K, "down", 768)):
        f = FORMATS[qtype]
        w = QuantWeight(qtype, (8, 64, K), {"qs": torch.zeros(8, 64, K // f.slot * f.V, dtype=torch.int32)})
        BN, NT, _ = tile(w, 4, num_warps=moe.NUM_WARPS)
        const = dict(TOP_K=8, TABLE=table, n_slots=K // f.slot, LOAD=f.triton_load, FIELD=f.triton_field,
                     V=f.V, P=f.P, BN=BN, NT=NT)
        planes = _plane_types(qtype, K) * 2   # host tier, bank
        if kind == "gate_up":
            _compile(moe._gate_up_kernel, ["*bf16", "*bf16", "*i32", "*i32", *planes, "i32", "i32", "i32"], const)
        else:
            const.pop("TOP_K")
            _compile(moe._down_part_kernel, ["*bf16", "*fp32", "*i32", "*i32", *planes, "i32", "i32"], const)
    _compile(moe.down_combine_kernel, ["*fp32", "*fp32", "*fp32", "i32"], dict(TOP_K=8, BD=moe.BD_COMBINE))
    _compile(route._route_kernel, ["*fp32", "*fp32", "*i32", "i32"], dict(TOP_K=8, BLOCK_E=128, BLOCK_K=8, NORM=True))


@pytest.mark.parametrize("table", [False, True], ids=["resident", "table"])
def test_moe_kernels_compile_for_sm90(table):
    run_in_child("tests.offload.test_compile", "compile_all", (table,))


def compile_contract() -> None:
    """The expert contract's kernels (kernels/moe/expert_q8_gpu.py with the mailbox words, and
    moe_i8's in their CONTRACT form skipping the CPU's pairs)."""
    from alphallama.kernels.moe import expert_q8_gpu as q8
    from alphallama.kernels.moe import moe_i8
    from alphallama.offload.mailbox import DONE, ERR, LAYER, REQ, ROWS
    from tests.kernels.test_moe_i8 import _sm90_args

    def build(kernel, types, const):
        compile_sm90(kernel, types, const, num_warps=q8.NUM_WARPS)
    # (gpt-oss's MXFP4 experts of its K = 2880: the level lookup, the biases, swiglu_oai)
    for qtype, K, oai in ((T.Q4_K, 2048, False), (T.Q6_K, 768, False), (T.Q8_0, 768, False), (T.MXFP4, 2880, True)):
        for kern in (moe_i8._gate_up_i8_kernel, moe_i8._down_i8_kernel):
            types, const = _sm90_args(qtype, K, kern, True)
            types[2] = "*fp32"                                          # the contract's act is fp32
            bias = {"HAS_EBIAS": True, **({"ACT": 2} if kern is moe_i8._gate_up_i8_kernel else {})} if oai else \
                {"ebias": None}
            const = {**const, **bias, "CONTRACT": True, "SKIP_TIER": 2}
            const |= {p.name: p.default for p in kern.params if p.is_constexpr and p.name not in const}
            build(kern, [*types, *(["*fp32"] if oai else []), "*i32"], const)   # ..., (ebias), tier
    for K in (2048, 2880):                                              # gpt-oss's d_model: KP 4096
        build(q8.q8_quantize_kernel, ["*bf16", "*i8", "*fp32", "*i32", "i32"],
              dict(K=K, KP=triton.next_power_of_2(K)))
    build(q8.q8_post_kernel, ["*i32"] * 8 + ["i32"] * 3,
          dict(BP=512, POST=True, GPU=True, REQ=REQ, LAYER=LAYER, ROWS=ROWS))
    build(q8.q8_combine_kernel, ["*fp32", "*fp32", "*fp32", "*i32", "*fp32", "*i32", "*i32", "i32"],
          dict(TOP_K=8, BD=q8.BD_COMBINE, WAIT=True, LIMIT=q8.SPIN_LIMIT, DONE=DONE, ERR=ERR))


def test_contract_kernels_compile_for_sm90():
    run_in_child("tests.offload.test_compile", "compile_contract", timeout=600)

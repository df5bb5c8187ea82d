"""Which runtime can compute each tensor of a file: the CPU reference (gguf/quants.py
dequantizes it to float32) and the GPU runtime (its weight formats, kernels/formats/qweight.py).

Both verdicts ask the runtimes' own registries (quant_type, format_of) and repeat their
refusal messages; nothing here lists types. What the GPU runtime does with a tensor:
- a matrix (2-D or 3-D, the embedding too when it is also the output head) becomes a
  GPU weight: its type needs a GPU format whose slot divides the row;
- a vector (norms) or an embedding with an output head of its own is dequantized by
  plain torch on the device: the CPU dequantizers' verdict;
- a layer's routed experts fuse gate and up into one weight: both of one type.
And whether the expert store's CPU workers can compute a file's routed experts: the expert
contract's formats, activation and shapes (kernels/moe/expert_q8.py; gpt-oss's MXFP4, biased
experts and swiglu_oai included), which the plan asks before it counts them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gguf.constants import GGML_QUANT_SIZES

from ..gguf.quants import quant_type
from ..gguf.reader import TensorInfo
from ..kernels.activations.act_ids import ACT_IDS
from ..kernels.formats.qweight import format_of
from ..kernels.moe.expert_q8 import QBLOCK, supports_act, supports_qtype

EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@dataclass(frozen=True)
class TypeUse:
    """One tensor type of a file: how many tensors, their bytes, and why each runtime
    would refuse it (None: it runs)."""
    qtype: str
    count: int
    nbytes: int
    cpu: str | None
    gpu: str | None

    @property
    def runs_on(self) -> str:
        return {(True, True): "cpu+gpu", (True, False): "cpu only",
                (False, True): "gpu only", (False, False): "none"}[(self.cpu is None, self.gpu is None)]

    def to_dict(self) -> dict:
        return {"count": self.count, "bytes": self.nbytes, "runs_on": self.runs_on,
                "cpu_refusal": self.cpu, "gpu_refusal": self.gpu}


def cpu_refusal(t: TensorInfo) -> str | None:
    try:
        quant_type(t.qtype)
    except ValueError as e:
        return str(e)
    return None


def is_gpu_matrix(name: str, t: TensorInfo, tensors: dict[str, TensorInfo]) -> bool:
    """Does the GPU runtime hold this tensor as a weight (else it dequantizes it)?"""
    if len(t.shape) < 2:
        return False
    return name != "token_embd.weight" or "output.weight" not in tensors


def gpu_refusal(name: str, t: TensorInfo, tensors: dict[str, TensorInfo]) -> str | None:
    if not is_gpu_matrix(name, t, tensors):
        return cpu_refusal(t)
    try:
        fmt = format_of(t.qtype)
    except ValueError as e:
        return str(e)
    K = int(t.shape[-1])
    if K % GGML_QUANT_SIZES[t.qtype][0] or K % fmt.slot:
        return f"{t.qtype.name}: rows of {K} values are not a multiple of the GPU slot of {fmt.slot}"
    return None


def type_uses(tensors: dict[str, TensorInfo]) -> dict[str, TypeUse]:
    """Per tensor type (by name, in the file's order of first use): counts, bytes and each
    runtime's verdict; a type's refusal names the first tensor refused."""
    acc: dict[str, dict] = {}
    for name, t in tensors.items():
        a = acc.setdefault(t.qtype.name, {"count": 0, "nbytes": 0, "cpu": None, "gpu": None})
        a["count"] += 1
        a["nbytes"] += t.nbytes
        for side, why in (("cpu", cpu_refusal(t)), ("gpu", gpu_refusal(name, t, tensors))):
            if why is not None and a[side] is None:
                a[side] = f"tensor {name!r}: {why}"
    return {q: TypeUse(q, **a) for q, a in acc.items()}


def gpu_problems(tensors: dict[str, TensorInfo]) -> list[str]:
    """Everything that would make the GPU runtime refuse this file: a refused type, or a
    layer whose experts' gate and up differ in type (the fused gate|up weight)."""
    out = [u.gpu for u in type_uses(tensors).values() if u.gpu is not None]
    for name, gate in tensors.items():
        m = re.fullmatch(r"(blk\.\d+\.)ffn_gate_exps\.weight", name)
        up = tensors.get(f"{m.group(1)}ffn_up_exps.weight") if m else None
        if up is not None and up.qtype != gate.qtype:
            out.append(f"{m.group(1)}: experts' gate ({gate.qtype.name}) and up ({up.qtype.name}) "
                       f"differ in type; the GPU fuses them into one weight")
    return out


def cpu_workers_refusal(tensors: dict[str, TensorInfo], act: str) -> str | None:
    """Why the expert store's CPU workers could not compute this file's routed experts
    (act: Variant.ffn_act), or None: the runtime's own test (moe_q8.contract_ok) on the
    tensor table: every expert type in the contract, rows of whole 32-value blocks (d_model
    and the expert width), an activation of the contract's."""
    if not supports_act(ACT_IDS.get(act, -1)):
        return f"the experts' {act} activation is outside the expert contract"
    for name, t in tensors.items():
        if not name.endswith(EXPERT_SUFFIXES):
            continue
        if not supports_qtype(t.qtype):
            return f"tensor {name!r}: {t.qtype.name} experts are outside the expert contract"
        if int(t.shape[-1]) % QBLOCK or int(t.shape[-2]) % QBLOCK:
            return f"tensor {name!r}: {list(t.shape)} is not whole {QBLOCK}-value blocks (the expert contract's)"
    return None


def cpu_problems(tensors: dict[str, TensorInfo]) -> list[str]:
    return [u.cpu for u in type_uses(tensors).values() if u.cpu is not None]

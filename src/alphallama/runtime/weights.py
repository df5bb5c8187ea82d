"""GGUF tensors -> the GPU runtime's layers: one map of a block's tensor names, used by the
model's loader and the MTP head's (gpu_mtp), and the layer built from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..gguf.arch import ModelConfig
from ..gguf.quants import dequantize
from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight, embedding_planes
from ..kernels.gemv.registry import DEFAULT_KERNELS, Kernels, MmaChoice
from ..offload.store import ExpertStore
from .linear import Linear
from .moe import Gating, MoE
from .overrides import PRODUCT, Overrides
from .shared_expert import SharedExpert


@dataclass(frozen=True)
class BlockNames:
    """A transformer block's GGUF tensor names under prefix p ("blk.3.", an MTP head's own)."""
    p: str

    def __getattr__(self, part: str) -> str:
        if part.startswith("_"):
            raise AttributeError(part)
        return f"{self.p}{part}.weight"

    def bias(self, part: str) -> str:
        return f"{self.p}{part}.bias"

    @property
    def qkv(self) -> tuple[str, str, str]:
        return self.attn_q, self.attn_k, self.attn_v

    @property
    def experts(self) -> tuple[str, str, str]:
        return self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps


@dataclass
class GPULayer:
    attn_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None       # dense FFN
    down: Linear | None
    moe: MoE | None = None       # routed experts instead
    shared: SharedExpert | None = None   # beside the routed experts (qwen2moe)
    post_attn_norm: torch.Tensor | None = None   # gemma3: rmsnorm of o(a) and of the FFN's output,
    post_ffn_norm: torch.Tensor | None = None    # each before its residual add (Variant.post_norms)
    sinks: torch.Tensor | None = None            # gpt-oss: [H] fp32, a sink logit a head (Variant.attn_sinks)
    o_bias: torch.Tensor | None = None           # gpt-oss: [D] fp32, o's bias (Variant.attn_out_bias)

    @property
    def nbytes(self) -> int:
        ffn = self.moe.nbytes if self.moe is not None else self.gate_up.nbytes + self.down.nbytes
        return self.qkv.nbytes + self.o.nbytes + ffn + (self.shared.nbytes if self.shared is not None else 0)


def vectors(t: dict[str, TensorInfo], device) -> Callable[[str], torch.Tensor]:
    """name -> that (small) tensor dequantized to float32 on the device (norms, biases)."""
    return lambda name: dequantize(t[name].data, t[name].qtype, t[name].shape).to(device)


def load_head(t: dict[str, TensorInfo], device, gemv: str, mma: MmaChoice | None = None,
              kernels: Kernels = DEFAULT_KERNELS) -> tuple[torch.Tensor, Linear, torch.Tensor | QuantWeight, object]:
    """(output_norm, the output Linear, the embedding table, its qtype): the embedding as planes,
    gathered by one kernel (a tied head's own planes); a format without planes keeps its raw
    rows [V, row_bytes], dequantized by plain torch (GPUModel.embed)."""
    output = Linear([t.get("output.weight") or t["token_embd.weight"]], device, gemv, mma=mma, kernels=kernels)
    emb = t["token_embd.weight"]
    if not embedding_planes(emb.qtype):
        embd = torch.from_numpy(emb.data.reshape(emb.shape[0], -1).view("uint8").copy()).to(device)
    elif "output.weight" not in t:
        embd = output.weights[0]
    else:
        embd = QuantWeight.from_raw(emb.data, emb.qtype, tuple(emb.shape), device)
    return vectors(t, device)("output_norm.weight"), output, embd, emb.qtype


def build_layer(t: dict[str, TensorInfo], n: BlockNames, cfg: ModelConfig, device, moe: bool,
                gemv: str = "f32", moe_gemv: str = "f32", split: bool = False, mma: MmaChoice | None = None,
                kernels: Kernels = DEFAULT_KERNELS, o: Overrides = PRODUCT, store: ExpertStore | None = None,
                layer: int = 0) -> GPULayer:
    """Block `n`'s layer: its dense weights on their plans (gemv, split runs for o and down,
    the tensor cores' choice), its experts resident or in `store` (as layer `layer`)."""
    vec, v = vectors(t, device), cfg.variant
    experts = None
    if moe:
        biases = None
        if v.expert_bias:       # gpt-oss: the router's [E], gate|up's [E, 2F] (as the fused weight's rows), down's [E, D]
            biases = (vec(n.bias("ffn_gate_inp")),
                      torch.cat([vec(n.bias("ffn_gate_exps")), vec(n.bias("ffn_up_exps"))], 1),
                      vec(n.bias("ffn_down_exps")))
        experts = MoE(t[n.ffn_gate_inp], *(t[x] for x in n.experts), cfg.n_experts_used, cfg.norm_topk_prob,
                      device, store, layer, moe_gemv, o.moe_prefill_fused,
                      Gating(v.ffn_act, v.moe_gating == "softmax_weight", biases))

    def lin(names, split_runs: bool = False) -> Linear:
        return Linear([t[x] for x in names], device, gemv, split=split_runs, mma=mma, kernels=kernels,
                      split_limits=o.split_limits)
    return GPULayer(
        attn_norm=vec(n.attn_norm),
        qkv=lin([n.attn_qkv] if v.fused_qkv else n.qkv),                      # phi3: q, k, v in one matrix
        qkv_bias=torch.cat([vec(n.bias(f"attn_{x}")) for x in "qkv"]) if cfg.qkv_bias else None,
        q_norm=vec(n.attn_q_norm) if cfg.qk_norm else None,
        k_norm=vec(n.attn_k_norm) if cfg.qk_norm else None,
        o=lin([n.attn_output], split),
        ffn_norm=vec(getattr(n, v.ffn_norm)),                                 # gpt-oss: post_attention_norm
        gate_up=None if moe else lin([n.ffn_up] if v.fused_gate_up else [n.ffn_gate, n.ffn_up]),   # phi3: [gate; up]
        down=None if moe else lin([n.ffn_down], split),
        moe=experts,
        post_attn_norm=vec(n.post_attention_norm) if v.post_norms else None,
        post_ffn_norm=vec(n.post_ffw_norm) if v.post_norms else None,
        sinks=vec(n.attn_sinks) if v.attn_sinks else None,
        o_bias=vec(n.bias("attn_output")) if v.attn_out_bias else None,
        shared=SharedExpert(lin([n.ffn_gate_shexp, n.ffn_up_shexp]), lin([n.ffn_down_shexp]), t[n.ffn_gate_inp_shexp],
                            device) if moe and v.shared_expert_ff else None)

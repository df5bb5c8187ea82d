"""GGUF tensors -> the GPU runtime's layers of a hybrid (qwen35, qwen35moe, qwen3next;
gguf/arch_qwen35.py): a Gated DeltaNet mixer or a gated full attention, then the dense or
MoE (+ gated shared expert) FFN, on the rooms the other models use (Linear, MoE,
SharedExpert). Row orders are fixed at load, never per round:

- attn_q holds [q_h, gate_h] per head: its q rows go with attn_k and attn_v into the qkv
  Linear ([q | k | v], what qkv_rope reads), its gate rows into a Linear of their own;
- the recurrent layer's z (attn_gate), beta and alpha share one Linear [z | beta | alpha];
  qwen3next's fused ssm_ba ([beta r, alpha r] per key head, r = Hv / Hk) is re-ordered to
  [beta (Hv) | alpha (Hv)] in value-head order (the reference's view(Hk, 2r) split).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..gguf.arch_qwen35 import HybridConfig
from ..gguf.reader import TensorInfo
from ..kernels.deltanet.common import DeltaNetShape
from ..kernels.deltanet.step import DeltaNetWeights
from ..kernels.gemv.registry import DEFAULT_KERNELS, Kernels
from ..offload.store import ExpertStore
from .linear import Linear
from .moe import MoE
from .shared_expert import SharedExpert
from .weights import BlockNames, vectors


def rows_of(t: TensorInfo, idx: list[int]) -> TensorInfo:
    """The matrix of t's rows idx, in that order (GGUF rows are independent runs of blocks)."""
    return replace(t, data=t.data.reshape(t.shape[0], -1)[idx], shape=(len(idx), *t.shape[1:]))


@dataclass
class Recurrent:
    """A Gated DeltaNet mixer; slot: its index among the recurrent layers (the cache's stacks)."""
    qkv: Linear               # attn_qkv [C, D]: the conv input (mix)
    zba: Linear               # [z (Hv dv) | beta (Hv) | alpha (Hv), D]
    norm: torch.Tensor        # ssm_norm [dv]
    out: Linear               # ssm_out [D, Hv dv]
    slot: int


@dataclass
class GatedAttention:
    """Full attention with a query gate, q/k norms and partial rope; slot: its K/V layer."""
    qkv: Linear               # [q (H hd) | k | v, D]
    gate: Linear              # [H hd, D]: attn_q's gate rows
    q_norm: torch.Tensor      # [hd]
    k_norm: torch.Tensor
    o: Linear                 # [D, H hd]
    slot: int


@dataclass
class HybridLayer:
    attn_norm: torch.Tensor
    mixer: Recurrent | GatedAttention
    ffn_norm: torch.Tensor                 # post_attention_norm: the FFN's input norm
    gate_up: Linear | None = None          # dense FFN
    down: Linear | None = None
    moe: MoE | None = None                 # routed experts
    shared: SharedExpert | None = None     # ... and the gated shared expert


def ba_order(hv: int, hk: int) -> list[int]:
    """qwen3next's ssm_ba rows -> [beta of value heads 0..Hv-1 | alpha of them]."""
    r = hv // hk
    return [kh * 2 * r + i for kh in range(hk) for i in range(r)] + \
           [kh * 2 * r + r + i for kh in range(hk) for i in range(r)]


def q_gate_rows(n_heads: int, hd: int) -> tuple[list[int], list[int]]:
    """attn_q's rows [q_h, gate_h] per head -> (the q rows, the gate rows), head-major."""
    q = [h * 2 * hd + c for h in range(n_heads) for c in range(hd)]
    return q, [i + hd for i in q]


def deltanet_shape(c: HybridConfig) -> DeltaNetShape:
    return DeltaNetShape(c.ssm_k_heads, c.ssm_v_heads, c.ssm_head_dim, c.ssm_head_dim, c.conv_kernel,
                         c.k_heads_tiled, c.norm_eps)


def stacked_deltanet(t: dict[str, TensorInfo], c: HybridConfig, device) -> DeltaNetWeights:
    """The recurrent layers' conv weights [Lr, C, d_conv], dt biases and ssm_a [Lr, Hv], stacked
    (the commit takes every layer in one launch; a layer's round takes its slice)."""
    vec = vectors(t, device)
    ps = [f"blk.{i}." for i in c.recurrent_layers]
    return DeltaNetWeights(torch.stack([vec(p + "ssm_conv1d.weight") for p in ps]).contiguous(),
                           torch.stack([vec(p + "ssm_dt.bias") for p in ps]).contiguous(),
                           torch.stack([vec(p + "ssm_a") for p in ps]).contiguous())


def build_hybrid_layer(t: dict[str, TensorInfo], i: int, c: HybridConfig, device, gemv: str = "f32",
                       moe_gemv: str = "f32", kernels: Kernels = DEFAULT_KERNELS,
                       attn_slot: int | None = None, store: ExpertStore | None = None) -> HybridLayer:
    """Block i of a hybrid on its plans (gemv: the dense GEMVs' family, as GPUModel's).
    attn_slot: a gated attention block past the model's layers with this K/V layer (the
    in-file MTP block, blk.{n_layers}: slot 0 of its own cache, runtime/hybrid_mtp.py).
    store: the model's expert store, which holds block i's routed experts (the shared expert
    stays resident)."""
    n, vec = BlockNames(f"blk.{i}."), vectors(t, device)

    def lin(parts: list[TensorInfo]) -> Linear:
        return Linear(parts, device, gemv, kernels=kernels)
    if attn_slot is None and c.recurrent[i]:
        ba = [rows_of(t[n.ssm_ba], ba_order(c.ssm_v_heads, c.ssm_k_heads))] if c.fused_ba \
            else [t[n.ssm_beta], t[n.ssm_alpha]]
        mixer = Recurrent(lin([t[n.attn_qkv]]), lin([t[n.attn_gate], *ba]), vec(n.ssm_norm), lin([t[n.ssm_out]]),
                          c.recurrent_layers.index(i))
    else:
        qr, gr = q_gate_rows(c.n_heads, c.head_dim)
        mixer = GatedAttention(lin([rows_of(t[n.attn_q], qr), t[n.attn_k], t[n.attn_v]]), lin([rows_of(t[n.attn_q], gr)]),
                               vec(n.attn_q_norm), vec(n.attn_k_norm), lin([t[n.attn_output]]),
                               c.attn_layers.index(i) if attn_slot is None else attn_slot)
    L = HybridLayer(vec(n.attn_norm), mixer, vec(n.post_attention_norm))
    if not c.is_moe:
        L.gate_up, L.down = lin([t[n.ffn_gate], t[n.ffn_up]]), lin([t[n.ffn_down]])
    else:
        L.moe = MoE(t[n.ffn_gate_inp], *(t[x] for x in n.experts), c.n_experts_used, c.norm_topk_prob, device,
                    store=store, layer=i, gemv=moe_gemv)
        L.shared = SharedExpert(lin([t[n.ffn_gate_shexp], t[n.ffn_up_shexp]]), lin([t[n.ffn_down_shexp]]),
                                t[n.ffn_gate_inp_shexp], device)
    return L

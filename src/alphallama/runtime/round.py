"""The decode round: a straight line over the plan made at load.

What each producer emits for the GEMV that reads its output (the norms, the SiLU and the
attention combine emit its int8 / q8_K activations) and which form a layer's residual
add takes is decided once per width (RoundPlan, from each Linear's plan:
kernels/gemv/registry.py); `rows` only reads it:

    embed (x sqrt(d): gemma) -> per layer: [add+RMSNorm] -> qkv GEMV -> bias/qk-norm/RoPE/KV write
          (-> q temperature) -> split-KV attention (a sliding window on SWA layers, gpt-oss's sinks)
          -> o GEMV (+ bias: gpt-oss) (-> post norm) -> [add+RMSNorm (+ the router's logits)]
          -> gate|up GEMV -> SiLU*up or GELU*up -> down GEMV (or the MoE layer, + its shared expert)
          (-> post norm) -> ... -> [add+RMSNorm] -> output GEMV (-> softcap)

A layer with post norms (gemma3) normalizes o's and the FFN's whole outputs before their
residual adds: no add in o's epilogue (norm_router), no partial-sum runs (gpu_model turns
the split off), the norm after them takes the normalized branch as its y. An o bias
(gpt-oss) likewise: o's whole output plus the bias is the norm's y (branch_out).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels.attention.decode import decode_attention, decode_attention_q8
from ..kernels.attention.rope import qkv_rope
from ..kernels.attention.rows import row_positions
from ..kernels.gemv.q8k_act import Q8K
from ..kernels.norm.rmsnorm import add_rmsnorm, add_rmsnorm_q8, rmsnorm_router_q8
from ..kv_cache import KVCache

if TYPE_CHECKING:
    from .gpu_model import GPUModel


@dataclass(frozen=True)
class LayerStep:
    """One layer at one width: the layouts each producer emits (() : none, plain kernel)."""
    attention: tuple          # the combine's (one lane order, or Q8K where head_dim is 128)
    norm_router: bool         # o adds into the residual in its epilogue, the FFN norm makes the router's logits
    o_runs: bool              # ... with o's partial-sum runs, added by the norm into a new residual
    ffn_norm: tuple           # the FFN norm's (gate|up's, or the experts')
    silu: tuple               # the SiLU's (the down's; dense layers)
    next_norm: tuple          # the next layer's attention norm's (or the output norm's, the head's)


@dataclass(frozen=True)
class RoundPlan:
    first_norm: tuple                  # layer 0's attention norm's
    layers: tuple[LayerStep, ...]


def _emitted(consumer, W: int, fuse: bool) -> tuple:
    """What a norm emits for `consumer` at width W: at most two of its layouts."""
    return consumer.orders(W)[:2] if fuse and consumer is not None else ()


def plan_round(m: "GPUModel", W: int) -> RoundPlan:
    """The round of W rows of model m (its Linears' and MoE layers' plans, m's options)."""
    c, fuse = m.cfg, m._fuse_q8
    layers = []
    for i, L in enumerate(m.layers):
        o_in = L.o.orders(W)
        lanes = tuple(o for o in o_in if o != Q8K)[:1] or \
            ((Q8K,) if Q8K in o_in and c.head_dim == 128 and c.n_heads % 2 == 0 else ())
        mo = L.moe
        router = (m.norm_router and mo is not None and mo.i8 and mo.link is None and mo.router_rows is not None
                  and fuse and L.o.adds(W) and L.post_attn_norm is None and L.o_bias is None)
        nxt = m.layers[i + 1].qkv if i + 1 < len(m.layers) else m.output
        layers.append(LayerStep(
            attention=lanes if fuse else (), norm_router=router, o_runs=router and L.o.runs(W) > 1,
            ffn_norm=_emitted(L.gate_up or mo, W, fuse),
            silu=L.down.orders(W) if mo is None and fuse else (), next_norm=_emitted(nxt, W, fuse)))
    return RoundPlan(_emitted(m.layers[0].qkv, W, fuse), tuple(layers))


def query_temperature(q: torch.Tensor, pos: torch.Tensor, scale: float, floor: int) -> torch.Tensor:
    """llama4 / mistral3: row r's q [W, H, hd] times 1 + scale * log(floor(p_r / floor) + 1),
    by row r's absolute position p_r (pos int32 [1]: pos + r, or a row table's: rows.py; on
    the device: no host sync, graph-captured), the factor in float64 then float32 as the
    reference computes it."""
    p = row_positions(pos, q.shape[0]).double()                                         # [W]
    f = (torch.log(torch.floor(p / floor) + 1) * scale + 1).float()                   # [W]
    return q * f[:, None, None]


def post_norm(m: "GPUModel", y: torch.Tensor, w: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """A branch's output y [W, D] fp32 before its residual add: rmsnorm(y) * w (gemma3's
    post_attention_norm / post_ffw_norm), fp32; y itself where the layer has none."""
    return y if w is None else add_rmsnorm(y, None, w, m.cfg.norm_eps, torch.float32, pdl)


def branch_out(m: "GPUModel", lin, bias: torch.Tensor | None, post: torch.Tensor | None, a: torch.Tensor,
               q8: dict | None, pdl: bool = False):
    """A branch's output before its residual add: lin(a) [W, D] (+ bias) (-> post norm); its
    runs (Linear.parts) for the norm to add where there is neither."""
    if bias is None and post is None:
        return lin.parts(a, q8, pdl)
    y = lin(a, q8, pdl)
    return post_norm(m, y if bias is None else y + bias, post, pdl)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """gemma's final logit softcapping: cap * tanh(logits / cap), as the reference (0: none)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def _norm(m: "GPUModel", x, y, w, orders: tuple):
    """x += y; rmsnorm(x) * w, with the activations `orders` name (if any)."""
    if not orders:
        return add_rmsnorm(x, y, w, m.cfg.norm_eps, m.act_dtype, m.pdl), None
    return add_rmsnorm_q8(x, y, w, m.cfg.norm_eps, m.act_dtype, orders, m.pdl)


def rows(m: "GPUModel", tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [W] int64 (device), pos int32 [1] or a row table [3, >= W] (device; kernels/attention/
    rows.py) -> (logits [W, V], hidden [W, D])."""
    c = m.cfg
    x = m.embed(tokens)                                                         # [W, D]
    kv_len = cache.k.shape[2]
    plan = m.round_plans[tokens.shape[0] - 1]
    act, pdl = m.act_dtype, m.pdl
    # each norm, the SiLU and the attention combine also emit the int8 activations of
    # the GEMVs that read their output (q8: {layout: activations})
    h, q8 = _norm(m, x, None, m.layers[0].attn_norm, plan.first_norm)
    for i, (L, s) in enumerate(zip(m.layers, plan.layers)):
        qkv = L.qkv(h, q8, pdl)                                                 # [W, (H + 2 n_kv) hd]
        cos, sin = m.ropes[i]
        q = qkv_rope(qkv, L.qkv_bias, L.q_norm, L.k_norm, cos, sin, cache.k[i], cache.v[i], pos,
                     c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.rope_neox, pdl)   # [W, H, hd]
        if m.q_temp is not None:
            q = query_temperature(q, pos, *m.q_temp)
        att = {"early": m.early_kv, "scale": m.attn_scale, "window": m.windows[i], "tiles": m.attn_tiles,
               "sinks": L.sinks}
        if s.attention:
            a, q8 = decode_attention_q8(q, cache.k[i], cache.v[i], pos, act, s.attention, pdl, **att)   # [W, H*hd]
        else:
            a, q8 = decode_attention(q, cache.k[i], cache.v[i], pos, kv_len, act, pdl, **att), None
        logits = None
        if not s.norm_router:       # x += o(a) (+ bias) (-> its post norm), then the FFN norm
            h, q8 = _norm(m, x, branch_out(m, L.o, L.o_bias, L.post_attn_norm, a, q8, pdl), L.ffn_norm, s.ffn_norm)
        else:         # x += o(a) in the GEMV; one launch: the norm and the router's logits
            parts, x_in = None, x
            if s.o_runs:          # o's runs, added by the norm into a new residual tensor
                parts, x = L.o.parts(a, q8, pdl), torch.empty_like(x)
            else:
                L.o.add_into(a, q8, x, pdl)
            x_out = x if parts is not None else None
            h, q8, logits = rmsnorm_router_q8(x_in, L.ffn_norm, L.moe.router_rows, c.norm_eps, act,
                                              s.ffn_norm, pdl, parts, x_out)   # [W, D], q8, [W, E]
        if L.moe is not None:     # [W, D], or its ranks unsummed for the next norm (combine_in_norm)
            d = L.moe(h, act, q8, pdl, logits=logits,
                      combine=not m.combine_in_norm or L.shared is not None or L.post_ffn_norm is not None)
            if L.shared is not None:
                d = d + L.shared(h, act, q8, pdl)                               # [W, D]
        else:
            gu = L.gate_up(h, q8, pdl)                                          # [W, 2F]
            if s.silu:            # SiLU*up, or GELU*up (m.gated), with the down's activations
                sm, q8 = m.gated.q8(gu, act, s.silu, pdl)                       # [W, F]
            else:
                sm, q8 = m.gated.plain(gu, act, pdl), None
            # [W, D] (or its runs; whole for a post norm)
            d = L.down.parts(sm, q8, pdl) if L.post_ffn_norm is None else L.down(sm, q8, pdl)
        d = post_norm(m, d, L.post_ffn_norm, pdl)
        nxt = m.output_norm if i + 1 == len(m.layers) else m.layers[i + 1].attn_norm
        h, q8 = _norm(m, x, d, nxt, s.next_norm)
    return softcap(m.output(h, q8, pdl), m.softcap), x

"""A hybrid's rows on the GPU: the decode / verify round (W <= 64 rows) and the prefill chunk.

    embed -> per layer: RMSNorm -> mixer -> [add+RMSNorm (post_attention_norm)] -> FFN
          -> [add+RMSNorm] -> ... -> output GEMV

The mixer (model/qwen35.py's math, llama.cpp's graphs):
- Gated DeltaNet: qkv GEMV -> mix [W, C]; [z | beta | alpha] GEMV (beta | alpha copied into
  the cache's round buffer, which the commit reads back); kernels/deltanet's step over the
  conv ring (mode step: the state written; verify: not, the cache's round stays open for the
  commit); the gated norm rms_norm(o) * w * silu(z) per value head (the norm kernel over
  [W * Hv, dv] rows, then an elementwise product); ssm_out GEMV.
- gated attention: qkv GEMV -> q/k norms, partial (qwen3next) or sectioned (M-RoPE, its turns
  folded into the tables) NEOX rope, K/V write (qkv_rope) -> split-KV attention -> times
  sigmoid(gate GEMV) -> o GEMV.
The FFN: gate|up GEMV -> SiLU*up -> down GEMV, or the routed experts (MoE) plus the gated
shared expert (SharedExpert).

Every piece is per row with a float order fixed by constexprs (the GEMV plans, the norm,
the step kernel's loop, the attention's splits), so a row's bits do not depend on the round's
width: exact mode verifies W rows in one pass. The prefill chunk (more than 64 rows) takes
the scratch's GEMMs (gpu_prefill.gemm_linear), deltanet_prefill (the chunked WY form), SDPA
and the MoE's grouped path: float32 tolerance, not the round's bits (design.md §7.3: the
prompt's last row goes through the round).

Parallel streams (a HybridSlots cache, runtime/hybrid_seats.py): a pass holds several streams'
rows; the attention takes the row table (each row's position and KV base), the recurrent
layer scatters the rows' gates into their slots' buffers and runs deltanet_slots (each stream
on its own ring and state); the rest is per row already.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kernels.activations.silu import silu_mul
from ..kernels.attention.decode import TILES, Tiles, decode_attention
from ..kernels.attention.rope import qkv_rope
from ..kernels.deltanet.prefill import deltanet_prefill
from ..kernels.deltanet.step import DeltaNetWeights, deltanet_slots, deltanet_step
from ..kernels.gemv.registry import ROWS_PER_THREAD
from ..kernels.norm.rmsnorm import add_rmsnorm
from .gpu_prefill import gemm_linear, moe_grouped, prefill_attention
from .hybrid_cache import GPUHybridCache, HybridSlots
from .hybrid_layers import GatedAttention, HybridLayer, Recurrent
from .hybrid_seats import Seats

if TYPE_CHECKING:
    from ..kv_cache import KVCache
    from .gpu_hybrid import GPUHybridModel
    from .hybrid_mtp import GPUHybridMTPHead


def layer_weights(m: GPUHybridModel, R: Recurrent) -> DeltaNetWeights:
    """Recurrent layer R's slice of the stacked conv weights, dt biases and ssm_a."""
    return DeltaNetWeights(*(x[R.slot] for x in m.deltanet))


def gated_norm(m: GPUHybridModel, o: torch.Tensor, z: torch.Tensor, w: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """rms_norm(o) * w * silu(z) per value head: o [T, Hv, dv], z [T, Hv * dv] -> [T, Hv * dv]."""
    T, hv, dv = o.shape
    n = add_rmsnorm(o.reshape(T * hv, dv), None, w, m.cfg.norm_eps, torch.float32)   # [T * Hv, dv]
    return (n.view(T, hv * dv) * F.silu(z)).to(out_dtype)


def _split_zba(m: GPUHybridModel, zba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Vd + 2 Hv] -> (z [T, Vd], beta | alpha [T, 2 Hv]): views."""
    vd = m.cfg.value_dim
    return zba[:, :vd], zba[:, vd:]


def recurrent_rows(m: GPUHybridModel, R: Recurrent, h: torch.Tensor, pos: torch.Tensor,
                   cache: GPUHybridCache | HybridSlots, verify: bool, seats: Seats | None = None) -> torch.Tensor:
    """A Gated DeltaNet layer's W rows (h [W, D] normed) -> its output [W, D] fp32. seats: a
    parallel-streams pass over the slots' cache (verify unused: each segment says)."""
    W, hv = h.shape[0], m.cfg.ssm_v_heads
    mix = R.qkv(h).contiguous()                                                 # [W, C]
    z, ba = _split_zba(m, R.zba(h))                                             # [W, Vd], [W, 2Hv]
    if seats is not None:
        ab = cache.ab[R.slot]                                                   # [N + 1, 64, 2Hv]: each slot's commit reads its own
        ab.view(-1, 2 * hv).index_copy_(0, seats.ab_rows[:W], ba)
        o = deltanet_slots(mix, ab, layer_weights(m, R), cache.ring[:, R.slot], cache.ssm[:, R.slot], seats.segs,
                           m.deltanet_shape)                                    # [W, Hv, dv]
    else:
        ab = cache.ab[R.slot, :W]                                               # [W, 2Hv]: the commit reads it back
        ab.copy_(ba)
        o = deltanet_step(mix, ab[:, hv:], ab[:, :hv], layer_weights(m, R), cache.ring[R.slot], cache.ssm[R.slot],
                          pos, m.deltanet_shape, write_state=not verify)        # [W, Hv, dv]
    return R.out(gated_norm(m, o, z, R.norm, m.act_dtype))


def _attention_q(m: GPUHybridModel | GPUHybridMTPHead, A: GatedAttention, qkv: torch.Tensor, pos: torch.Tensor,
                 cache: KVCache) -> torch.Tensor:
    """q/k norms and rope of qkv [T, (H + 2 n_kv) hd], K/V written -> q [T, H, hd]."""
    c = m.cfg
    return qkv_rope(qkv, None, A.q_norm, A.k_norm, m.cos, m.sin, cache.k[A.slot], cache.v[A.slot], pos,
                    c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, True, rope_dim=c.rope_dim)


def attention_rows(m: GPUHybridModel | GPUHybridMTPHead, A: GatedAttention, h: torch.Tensor, pos: torch.Tensor,
                   cache: KVCache, tiles: Tiles = TILES) -> torch.Tensor:
    """A gated attention layer's W rows (h [W, D] normed) -> its output [W, D] fp32. m: the
    model or its MTP head (each has cfg, its rope tables cos / sin and act_dtype). pos: one
    stream's int32 [1] or a row table (rows.py); tiles: the split attention's."""
    q = _attention_q(m, A, A.qkv(h), pos, cache)                                # [W, H, hd]
    a = decode_attention(q, cache.k[A.slot], cache.v[A.slot], pos, cache.k.shape[2], tiles=tiles)   # [W, H*hd] fp32
    return A.o((a * torch.sigmoid(A.gate(h))).to(m.act_dtype))


def ffn_rows(m: GPUHybridModel | GPUHybridMTPHead, L: HybridLayer, h: torch.Tensor) -> torch.Tensor:
    """The FFN of W rows (h [W, D] normed) -> [W, D] fp32 (m: the model or its MTP head)."""
    act = m.act_dtype
    if L.moe is None:
        return L.down(silu_mul(L.gate_up(h), act))
    return L.moe(h, act) + L.shared(h, act)


def rows(m: GPUHybridModel, tokens: torch.Tensor, pos: torch.Tensor, cache: GPUHybridCache | HybridSlots,
         verify: bool, seats: Seats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [W] int64 (device), pos int32 [1] (device) -> (logits [W, V], hidden [W, D]).
    verify: the recurrent states are left as they were (the cache's round commits them).
    seats: a parallel-streams pass (pos is seats.table, cache the HybridSlots; the segments
    say which streams' states are written)."""
    c, act = m.cfg, m.act_dtype
    x = m.embed(tokens)                                                         # [W, D] the residual
    h = add_rmsnorm(x, None, m.layers[0].attn_norm, c.norm_eps, act)
    for i, L in enumerate(m.layers):
        if isinstance(L.mixer, Recurrent):
            y = recurrent_rows(m, L.mixer, h, pos, cache, verify, seats)
        else:
            y = attention_rows(m, L.mixer, h, pos, cache, m.attn_tiles)
        h = add_rmsnorm(x, y, L.ffn_norm, c.norm_eps, act)                      # x += mixer
        nxt = m.layers[i + 1].attn_norm if i + 1 < len(m.layers) else m.output_norm
        h = add_rmsnorm(x, ffn_rows(m, L, h), nxt, c.norm_eps, act)             # x += ffn
    return m.output(h), x


def prefill_rows(m: GPUHybridModel, tokens: torch.Tensor, pos: int, cache: GPUHybridCache,
                 logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One prefill chunk: tokens [T] at pos.. -> (logits [T, V] or None, hidden [T, D]); the
    states and rings advanced (deltanet_prefill), K/V written."""
    c, s = m.cfg, m.scratch
    act, hv = s.dtype, c.ssm_v_heads
    x = m.embed(tokens)                                                         # [T, D]
    pos_t = torch.full((1,), pos, dtype=torch.int32, device=m.device)
    h = add_rmsnorm(x, None, m.layers[0].attn_norm, c.norm_eps, act)
    for i, L in enumerate(m.layers):
        mx = L.mixer
        if isinstance(mx, Recurrent):
            z, ba = _split_zba(m, gemm_linear(mx.zba, h, s))                     # [T, Vd], [T, 2Hv]
            o = deltanet_prefill(gemm_linear(mx.qkv, h, s).contiguous(), ba[:, hv:], ba[:, :hv],
                                 layer_weights(m, mx), cache.ring[mx.slot], cache.ssm[mx.slot], pos,
                                 m.deltanet_shape, rule=m.delta_rule)           # [T, Hv, dv]
            y = gemm_linear(mx.out, gated_norm(m, o, z, mx.norm, act), s)
        else:
            q = _attention_q(m, mx, gemm_linear(mx.qkv, h, s), pos_t, cache)   # [T, H, hd]
            a = prefill_attention(q, cache.k[mx.slot], cache.v[mx.slot], pos, torch.float32)   # [T, H*hd]
            y = gemm_linear(mx.o, (a * torch.sigmoid(gemm_linear(mx.gate, h, s))).to(act), s)
        h = add_rmsnorm(x, y, L.ffn_norm, c.norm_eps, act)
        if L.moe is None:
            d = gemm_linear(L.down, silu_mul(gemm_linear(L.gate_up, h, s), act), s)
        else:
            d = moe_grouped(L.moe, h, s, ROWS_PER_THREAD) + L.shared(h, act, gemm=lambda lin, y: gemm_linear(lin, y, s))
        nxt = m.layers[i + 1].attn_norm if i + 1 < len(m.layers) else m.output_norm
        h = add_rmsnorm(x, d, nxt, c.norm_eps, act)
    return (gemm_linear(m.output, h, s) if logits else None), x

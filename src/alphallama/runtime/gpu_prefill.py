"""Prefill chunks (more than MAX_W rows) through the tensor cores.

The decode round (gpu_model._rows) is a GEMV per weight: right for W <= 64 rows, but a
512-row chunk through it re-reads every weight 8 times on the CUDA cores. Here the
same layer sequence runs eagerly with each quantized matrix dequantized into the
model's scratch and multiplied by cuBLAS (kernels/qgemm.py), attention by torch SDPA
over the cache prefix (flash, causal aligned bottom-right), and the small fused
kernels as in decode. The chunk's GEMMs are known ahead, so they are handed to the
scratch as a plan: each weight is dequantized while the GEMM before it runs.

MoE layers: the router and the top-k are the decode kernels (a GEMV: the router is
small); the chunk's (row, slot) pairs are then grouped by expert and each routed
expert runs as two GEMMs on its dequantized gate|up and down over its rows (one
host sync per layer for the list of experts hit; the experts' weights then join the
plan). Each pair's output is written
once and the k of a row are summed in slot order: deterministic, no atomics. With
an expert store the model keeps the decode path for prefill altogether.

These rows' bits differ from what the decode graphs would compute (cuBLAS sums in its
own order, SDPA is not the split-KV kernel); gpu_model.py says what that changes.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..gguf.quants import dequantize
from ..kernels.fused import add_rmsnorm, qkv_rope, silu_mul
from ..kernels.moe import moe_route
from ..kernels.qgemm import Scratch
from ..kernels.qmatmul import qmatmul


def gemm_linear(lin, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """A gpu_model.Linear through the scratch's GEMMs: x [T, K] -> [T, sum N] float32
    (its matrices of different types share one buffer and one GEMM where they fit)."""
    return scratch.gemm(x, scratch.units(lin.weights))


def plan_from(m, i: int, logits: bool, scratch: Scratch) -> list:
    """The GEMM units from layer i on, in call order, up to the first MoE layer's
    attention output (its experts are known only after routing) or the end."""
    units = []
    for L in m.layers[i:]:
        units += scratch.units(L.qkv.weights) + scratch.units(L.o.weights)
        if L.moe is not None:
            return units
        units += scratch.units(L.gate_up.weights) + scratch.units(L.down.weights)
    return units + (scratch.units(m.output.weights) if logits else [])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """q [T, H, hd] (rows at pos..pos+T-1), k/v [n_kv, max_len, hd] with rows 0..pos+T-1
    written -> [T, H * hd] in out_dtype. Row t sees keys 0..pos+t."""
    T, H, hd = q.shape
    n_kv, L = k.shape[0], pos + T
    dt = k.dtype if q.is_cuda else torch.float32          # fp16 tensor cores; fp32 on CPU
    # 4-D: torch's fused kernels (flash, mem-efficient) take only [B, H, T, hd]; on 3-D
    # inputs SDPA falls back to its math path (fp32 bmm + softmax, ~8 ms of a 512-row
    # chunk of the 8B shape on the H200 at 2bb2018)
    qh = q.transpose(0, 1).to(dt)[None]                          # [1, H, T, hd]
    kk = k[:, :L].to(dt).repeat_interleave(H // n_kv, 0)[None]   # [1, H, L, hd]
    vv = v[:, :L].to(dt).repeat_interleave(H // n_kv, 0)[None]   # [1, H, L, hd]
    if pos == 0:
        o = F.scaled_dot_product_attention(qh, kk, vv, is_causal=True)  # [1, H, T, hd]
    else:
        # is_causal aligns the triangle top-left; with a prefix it sits bottom-right,
        # which the flash kernel takes as such (an explicit mask would rule flash out)
        o = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=causal_lower_right(T, L))  # [1, H, T, hd]
    return o[0].transpose(0, 1).reshape(T, H * hd).to(out_dtype)  # [T, H*hd]


def moe_grouped(moe, h: torch.Tensor, scratch: Scratch, rows_per_thread: int) -> torch.Tensor:
    """A gpu_model.MoE (experts resident) over a chunk, experts grouped: [T, D] -> [T, D] fp32."""
    T = h.shape[0]
    logits = qmatmul(h, moe.router, rows_per_thread=rows_per_thread)           # [T, E]
    weights, experts = moe_route(logits, moe.top_k, moe.norm)                  # [T, k] each
    flat = experts.flatten().long()                                            # [T * k]
    y = torch.empty(T * moe.top_k, moe.down.N, dtype=torch.float32, device=h.device)  # [T * k, D]
    order = torch.argsort(flat, stable=True)                                   # [T * k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=moe.gate_up.shape[0]).tolist()     # one host sync per layer
    starts = [0, *itertools.accumulate(counts)]
    hit = [e for e, n in enumerate(counts) if n]
    units = [(scratch.units([moe.gate_up.expert(e)], cache=False), scratch.units([moe.down.expert(e)], cache=False))
             for e in hit]
    scratch.expect([u for gu_dn in units for part in gu_dn for u in part])
    for e, (gu_units, dn_units) in zip(hit, units):
        pairs = order[starts[e]:starts[e] + counts[e]]                         # [n] (row, slot) pairs
        gu = scratch.gemm(h[pairs // moe.top_k], gu_units)                     # [n, 2F]
        y[pairs] = scratch.gemm(silu_mul(gu, scratch.dtype), dn_units)         # [n, D]
    return (y.view(T, moe.top_k, -1) * weights[:, :, None]).sum(1)            # [T, D]


def prefill_rows(m, tokens: torch.Tensor, pos: int, cache, logits: bool,
                 rows_per_thread: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One chunk: tokens [T] int64 (device) at pos..pos+T-1 of `cache` (GPUModel `m`)
    -> (logits [T, V] float32 or None, hidden [T, D])."""
    c = m.cfg
    T = tokens.shape[0]
    s = m.scratch
    act = s.dtype                     # GEMM inputs: bf16 on the GPU, fp32 in tests
    pos_t = torch.full((1,), pos, dtype=torch.int32, device=m.device)      # a fill, not a synchronous copy
    x = dequantize(m.embd[tokens], m.embd_qtype, (T, c.d_model))            # [T, D] fp32 residual
    h = add_rmsnorm(x, None, m.layers[0].attn_norm, c.norm_eps, act)        # [T, D]
    for i, L in enumerate(m.layers):
        if i == 0 or m.layers[i - 1].moe is not None:
            s.plan(plan_from(m, i, logits, s))
        qkv = gemm_linear(L.qkv, h, s)                                      # [T, (H + 2 n_kv) hd]
        q = qkv_rope(qkv, L.qkv_bias, L.q_norm, L.k_norm, m.cos, m.sin, cache.k[i], cache.v[i], pos_t,
                     c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.rope_neox)  # [T, H, hd]
        a = prefill_attention(q, cache.k[i], cache.v[i], pos, act)          # [T, H*hd]
        h = add_rmsnorm(x, gemm_linear(L.o, a, s), L.ffn_norm, c.norm_eps, act)   # x += o(a)
        if L.moe is not None:
            d = moe_grouped(L.moe, h, s, rows_per_thread)                    # [T, D]
        else:
            d = gemm_linear(L.down, silu_mul(gemm_linear(L.gate_up, h, s), act), s)  # [T, D]
        nxt = m.layers[i + 1].attn_norm if i + 1 < len(m.layers) else m.output_norm
        h = add_rmsnorm(x, d, nxt, c.norm_eps, act)
    return (gemm_linear(m.output, h, s) if logits else None), x

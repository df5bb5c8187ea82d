"""Transformer building blocks in plain PyTorch (float32 on CPU: the reference).

Every function works on a block of T rows at consecutive positions; the GPU kernels are
checked against these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., D], w: [D]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(max_len: int, rope_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of pos * base^(-2i/rope_dim), [max_len, rope_dim/2], computed in float64
    then rounded once, so the tables do not depend on the device."""
    inv = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)  # [rope_dim/2]
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]       # [max_len, rope_dim/2]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate the first rope_dim dims of each head.

    x: [T, n_heads, head_dim]; cos/sin: [T, rope_dim/2].
    neox (Qwen): pairs are (i, i + rope_dim/2); otherwise (llama GGUF): pairs (2i, 2i+1).
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]                   # [T, 1, half]
    if neox:
        a, b = rot[..., :half], rot[..., half:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Causal attention of T query rows at positions pos..pos+T-1 over keys 0..pos+T-1.

    q: [T, n_heads, hd]; k, v: [n_kv, pos+T, hd]  ->  [T, n_heads * hd]
    """
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_heads // n_kv
    qh = q.transpose(0, 1).reshape(n_kv, group * T, hd)        # [n_kv, group*T, hd]: heads sharing a kv head
    scores = qh @ k.transpose(1, 2) / hd ** 0.5                # [n_kv, group*T, L]
    row_pos = pos + torch.arange(T).repeat(group)              # [group*T] position of each query row
    mask = torch.arange(L)[None, :] > row_pos[:, None]         # [group*T, L] True = future key
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v                    # [n_kv, group*T, hd]
    return out.reshape(n_heads, T, hd).transpose(0, 1).reshape(T, n_heads * hd)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    # x: [T, D]; gate/up: [F, D]; down: [D, F]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def moe(x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
        down: torch.Tensor, top_k: int, norm_topk: bool) -> torch.Tensor:
    """Routed experts: softmax over all experts, keep the top k, optionally renormalise.

    x: [T, D]; router: [E, D]; gate/up: [E, F, D]; down: [E, D, F]
    """
    probs = torch.softmax(F.linear(x, router), dim=-1)        # [T, E]
    weights, experts = probs.topk(top_k, dim=-1)               # [T, k], [T, k]
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)     # tokens routed to expert e
        y = swiglu(x[rows], gate[e], up[e], down[e])           # [n_e, D]
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out

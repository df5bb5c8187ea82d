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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float | None = None,
              window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of T query rows at positions pos..pos+T-1 over keys 0..pos+T-1.

    q: [T, n_heads, hd]; k, v: [n_kv, pos+T, hd]  ->  [T, n_heads * hd]
    scale: of q.k (default 1/sqrt(hd)); window > 0: a row at p sees keys p - window < j <= p;
    sinks [n_heads]: one more logit per head in the softmax's denominator (no value).
    """
    T, n_heads, hd = q.shape
    n_kv, L, _ = k.shape
    group = n_heads // n_kv
    qh = q.transpose(0, 1).reshape(n_kv, group * T, hd)        # [n_kv, group*T, hd]: heads sharing a kv head
    scores = qh @ k.transpose(1, 2)                            # [n_kv, group*T, L]
    scores = scores / hd ** 0.5 if scale is None else scores * scale
    row_pos = pos + torch.arange(T).repeat(group)              # [group*T] position of each query row
    key_pos = torch.arange(L)[None, :]                         # [1, L]
    mask = key_pos > row_pos[:, None]                          # [group*T, L] True = hidden key
    if window:
        mask |= row_pos[:, None] - key_pos >= window
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(scores, dim=-1)                      # [n_kv, group*T, L]
    else:
        sink = sinks.view(n_kv, group, 1, 1).expand(n_kv, group, T, 1).reshape(n_kv, group * T, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :L]
    out = p @ v                                                # [n_kv, group*T, hd]
    return out.reshape(n_heads, T, hd).transpose(0, 1).reshape(T, n_heads * hd)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss: gate clamped above at limit, up to [-limit, limit]; gate*sigmoid(alpha*gate)*(up+1)."""
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + 1)


def gelu_fp16_table(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's CPU GELU (ggml_vec_gelu_f32 with GGML_GELU_FP16): x rounded to fp16,
    looked up in a table of fp16 results; 0 below -10, x above 10. Not the model's
    activation (that is gelu_tanh): it lets a test show that llama.cpp's table is the
    whole of a difference."""
    t = gelu_tanh(x.half().float()).half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, t))


# gated activations: (gate pre-activation, up) -> the FFN's hidden values
ACTIVATIONS = {
    "silu": lambda g, u: F.silu(g) * u,
    "gelu": lambda g, u: gelu_tanh(g) * u,
    "gelu_fp16_table": lambda g, u: gelu_fp16_table(g) * u,
    "swiglu_oai": swiglu_oai,
}


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    # x: [T, D]; gate/up: [F, D]; down: [D, F]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _gate_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(logits, dim=-1).topk(top_k, dim=-1)   # softmax over all experts, keep k


def _gate_softmax_weight(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top, experts = logits.topk(top_k, dim=-1)                   # the k largest logits, then their softmax
    return torch.softmax(top, dim=-1), experts


# router logits [T, E] -> (weights [T, k], experts [T, k])
GATINGS = {"softmax": _gate_softmax, "softmax_weight": _gate_softmax_weight}


def moe(x: torch.Tensor, router: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
        down: torch.Tensor, top_k: int, norm_topk: bool, router_bias: torch.Tensor | None = None,
        gating: str = "softmax", biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        act: str = "silu") -> torch.Tensor:
    """Routed experts: gate the router's logits (GATINGS), keep the top k, optionally renormalise.

    x: [T, D]; router: [E, D] (+ bias [E]); gate/up: [E, F, D]; down: [E, D, F];
    biases: the experts' (gate [E, F], up [E, F], down [E, D]); act: ACTIVATIONS key.
    """
    weights, experts = GATINGS[gating](F.linear(x, router, router_bias), top_k)   # [T, k], [T, k]
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)     # tokens routed to expert e
        if biases is None and act == "silu":
            y = swiglu(x[rows], gate[e], up[e], down[e])       # [n_e, D]
        else:
            gb, ub, db = biases if biases is not None else (None, None, None)
            h = ACTIVATIONS[act](F.linear(x[rows], gate[e], None if gb is None else gb[e]),
                                 F.linear(x[rows], up[e], None if ub is None else ub[e]))   # [n_e, F]
            y = F.linear(h, down[e], None if db is None else db[e])                        # [n_e, D]
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out

"""The embedded model as a torch module for training: `qwen3moe` (q/k norms, neox RoPE,
routed SwiGLU experts with top-k renormalised softmax routing, tied output head), the
same function as alphallama.model.Transformer computes from the exported GGUF.

    cfg = MoEConfig(vocab_size=..., ...);  model = MoEModel(cfg)
    hidden, aux = model(tokens)            # tokens [B, T] -> hidden [B, T, D] before the
                                           # final norm (what the MTP head takes), aux scalar
    logits = model.logits(hidden)          # [B, T, V] (= F.linear(model.normed(hidden), model.embed))
    model.gguf_tensors()                   # {llama.cpp name: float32 tensor}
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gguf.arch import ModelConfig
from ..gguf.arch_variants import RopeScaling, Variant
from ..model.layers import apply_rope, rope_tables
from .mtp import rms


def autocast(device: str):
    """bf16 autocast on CUDA (training and rollouts); nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    d_ff_expert: int
    ctx_len: int
    norm_eps: float = 1e-6
    rope_base: float = 1e6

    def model_config(self) -> ModelConfig:
        """The ModelConfig our GGUF reader derives from the exported file."""
        import numpy as np
        return ModelConfig(
            arch="qwen3moe", n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, d_ff=self.d_ff_expert,
            vocab_size=self.vocab_size, ctx_len=self.ctx_len, norm_eps=float(np.float32(self.norm_eps)),
            rope_base=float(np.float32(self.rope_base)), rope_dim=self.head_dim, rope_neox=True,
            qk_norm=True, n_experts=self.n_experts, n_experts_used=self.n_experts_used,
            d_ff_expert=self.d_ff_expert, tied_embeddings=True,
            variant=Variant(rope=RopeScaling(orig_ctx=self.ctx_len)))   # the reader's default: the training context


class Block(nn.Module):
    def __init__(self, c: MoEConfig, std: float, out_std: float):
        super().__init__()
        self.c = c
        D, Q, KV, E, Fe = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_experts, c.d_ff_expert
        ones = lambda n: nn.Parameter(torch.ones(n))  # noqa: E731
        normal = lambda *s, sd=std: nn.Parameter(torch.randn(*s) * sd)  # noqa: E731
        self.attn_norm, self.ffn_norm = ones(D), ones(D)
        self.q_norm, self.k_norm = ones(c.head_dim), ones(c.head_dim)
        self.wq, self.wk, self.wv = normal(Q, D), normal(KV, D), normal(KV, D)
        self.wo = normal(D, Q, sd=out_std)
        self.router = normal(E, D)
        self.gate, self.up = normal(E, Fe, D), normal(E, Fe, D)          # [E, F, D]
        self.down = normal(E, D, Fe, sd=out_std)                          # [E, D, F]

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  past: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(output [B, T, D], this layer's (k, v) [B, n_kv, T_past + T, hd]); `past`: the
        earlier positions' (k, v), then T must be 1 (a decode step: nothing to mask)."""
        c = self.c
        B, T, _ = x.shape
        h = rms(x, self.attn_norm, c.norm_eps)
        q = rms(F.linear(h, self.wq).view(B, T, c.n_heads, c.head_dim), self.q_norm, c.norm_eps)
        k = rms(F.linear(h, self.wk).view(B, T, c.n_kv_heads, c.head_dim), self.k_norm, c.norm_eps)
        v = F.linear(h, self.wv).view(B, T, c.n_kv_heads, c.head_dim)           # [B, T, n_kv, hd]
        q = apply_rope(q, cos, sin, True).to(v.dtype).transpose(1, 2)           # [B, H, T, hd]
        k = apply_rope(k, cos, sin, True).to(v.dtype).transpose(1, 2)           # [B, n_kv, T, hd]
        v = v.transpose(1, 2)
        if past is not None:
            assert T == 1, "a step after cached positions takes one token"
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        g = c.n_heads // c.n_kv_heads
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                           is_causal=past is None)             # [B, H, T, hd]
        return F.linear(a.transpose(1, 2).reshape(B, T, -1), self.wo), (k, v)  # [B, T, D]

    def moe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed experts over the rows of x [N, D]: softmax over all experts, top-k,
        weights renormalised to 1 (llama.cpp's qwen3moe). Also the load-balancing loss
        E * sum_e(share of routed slots_e * mean router prob_e) (1 when balanced)."""
        c = self.c
        N = x.shape[0]
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)        # [N, E]
        w, idx = probs.topk(c.n_experts_used, dim=-1)                          # [N, k]
        w = w / w.sum(-1, keepdim=True)
        flat = idx.flatten()                                                   # [N*k] expert of each slot
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=c.n_experts)                   # [E]
        rows = order // c.n_experts_used                                       # [N*k] token of each sorted slot
        xs = x[rows]                                                           # [N*k, D]
        ys = []
        for e, chunk in enumerate(xs.split(counts.tolist())):
            if chunk.shape[0]:
                ys.append(F.linear(F.silu(F.linear(chunk, self.gate[e])) * F.linear(chunk, self.up[e]),
                                   self.down[e]))                              # [n_e, D]
        y = torch.cat(ys).float() * w.flatten()[order, None]                   # [N*k, D]
        out = torch.zeros(N, x.shape[1], device=x.device, dtype=torch.float32).index_add_(0, rows, y)
        aux = c.n_experts * (counts.float() / flat.numel() * probs.mean(0)).sum()
        return out, aux

    def forward(self, x, cos, sin, past=None):
        a, kv = self.attention(x, cos, sin, past)
        x = x + a
        B, T, D = x.shape
        f, aux = self.moe(rms(x, self.ffn_norm, self.c.norm_eps).reshape(B * T, D))
        return x + f.view(B, T, D), aux, kv


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig, std: float = 0.02):
        super().__init__()
        self.cfg = cfg
        out_std = std / math.sqrt(2 * cfg.n_layers)   # GPT-2's scaling of the residual writers
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * std)   # [V, D], tied head
        self.blocks = nn.ModuleList(Block(cfg, std, out_std) for _ in range(cfg.n_layers))
        self.out_norm = nn.Parameter(torch.ones(cfg.d_model))

    def forward(self, tokens: torch.Tensor, cache: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (hidden [B, T, D], aux). `cache`: a list of each layer's (k, v),
        filled by a call with an empty list (the prompt) and extended by each later call of
        one token a row (greedy rollouts, unlikely.py); None for training."""
        c = self.cfg
        T = tokens.shape[1]
        cached = bool(cache)
        pos = cache[0][0].shape[2] if cached else 0
        cos, sin = (t[pos:].to(tokens.device) for t in rope_tables(pos + T, c.head_dim, c.rope_base))  # [T, hd/2]
        x = F.embedding(tokens, self.embed)                                   # [B, T, D]
        aux = x.new_zeros(())
        for i, b in enumerate(self.blocks):
            x, a, kv = b(x, cos, sin, cache[i] if cached else None)
            aux = aux + a
            if cached:
                cache[i] = kv
            elif cache is not None:
                cache.append(kv)
        return x, aux / c.n_layers

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's input: the final norm of the hidden state [B, T, D]."""
        return rms(hidden, self.out_norm, self.cfg.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.normed(hidden), self.embed)                       # [B, T, V]

    def gguf_tensors(self) -> dict[str, torch.Tensor]:
        """{llama.cpp name: float32 copy on CPU}, in no particular order."""
        return {k: v.detach().float().cpu() for k, v in self.gguf_params().items()}

    def gguf_params(self) -> dict[str, nn.Parameter]:
        """{llama.cpp name: the parameter itself}."""
        out = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm}
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            out |= {p + "attn_norm.weight": b.attn_norm, p + "attn_q.weight": b.wq,
                    p + "attn_k.weight": b.wk, p + "attn_v.weight": b.wv,
                    p + "attn_output.weight": b.wo, p + "attn_q_norm.weight": b.q_norm,
                    p + "attn_k_norm.weight": b.k_norm, p + "ffn_norm.weight": b.ffn_norm,
                    p + "ffn_gate_inp.weight": b.router, p + "ffn_gate_exps.weight": b.gate,
                    p + "ffn_up_exps.weight": b.up, p + "ffn_down_exps.weight": b.down}
        return out

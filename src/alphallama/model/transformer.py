"""The reference transformer: llama, qwen2, qwen3 and qwen3moe in one module, chosen by
the flags of ModelConfig (biases, q/k norms, routed experts, rope layout), never by name.

Float32 on CPU, weights dequantized once at load. The GPU runtime is checked against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gguf.arch import ModelConfig
from ..kv_cache import KVCache
from .layers import apply_rope, attention, moe, rms_norm, rope_tables, swiglu


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_len: int):
        self.cfg = cfg
        self.w = weights
        self.max_len = max_len
        self.cos, self.sin = rope_tables(max_len, cfg.rope_dim, cfg.rope_base)  # [max_len, rope_dim/2]
        self.output = weights.get("output.weight", weights["token_embd.weight"])   # [V, D] (tied if absent)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, max_len or self.max_len, c.head_dim)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _layer(self, i: int, x: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        T = x.shape[0]
        h = rms_norm(x, w[p + "attn_norm.weight"], c.norm_eps)                   # [T, D]
        q = self._linear(h, p + "attn_q")                                        # [T, H*hd]
        k = self._linear(h, p + "attn_k")                                        # [T, n_kv*hd]
        v = self._linear(h, p + "attn_v")                                        # [T, n_kv*hd]
        q = q.view(T, c.n_heads, c.head_dim)
        k = k.view(T, c.n_kv_heads, c.head_dim)
        v = v.view(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], c.norm_eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], c.norm_eps)
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]
        q = apply_rope(q, cos, sin, c.rope_neox)
        k = apply_rope(k, cos, sin, c.rope_neox)
        cache.k[i, :, pos:pos + T] = k.transpose(0, 1)                           # [n_kv, T, hd]
        cache.v[i, :, pos:pos + T] = v.transpose(0, 1)
        a = attention(q, cache.k[i, :, :pos + T], cache.v[i, :, :pos + T], pos)  # [T, H*hd]
        x = x + self._linear(a, p + "attn_output")
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.norm_eps)
        if c.is_moe:
            f = moe(h, w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_exps.weight"],
                    w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"],
                    c.n_experts_used, c.norm_topk_prob)
        else:
            f = swiglu(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
        return x + f

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos: int, cache: KVCache,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run T rows at positions pos..pos+T-1, writing their K/V into the cache.

        tokens: [T] int64 -> (logits [T, V] float32, final hidden state [T, D]).
        The cache's committed length becomes pos+T. logits=False skips the output head
        (prefill chunks whose logits nobody reads: on a 150k vocabulary the head costs
        more than the layers of a small model).
        """
        T = tokens.shape[0]
        if pos > cache.length or pos + T > cache.max_len:
            raise ValueError(f"rows {pos}..{pos + T} do not fit a cache of {cache.length}/{cache.max_len}")
        x = self.w["token_embd.weight"][tokens]                                   # [T, D]
        for i in range(self.cfg.n_layers):
            x = self._layer(i, x, pos, cache)
        cache.length = pos + T
        if not logits:
            return None, x
        h = rms_norm(x, self.w["output_norm.weight"], self.cfg.norm_eps)
        return F.linear(h, self.output), x

    def verify(self, tokens: torch.Tensor, pos: int, cache: KVCache, exact: bool = True):
        """A decode round: W rows (the last committed token and W-1 drafts).

        exact: every row gets bit-identical results to a W = 1 pass at its position,
        by construction: the rows run one after another through the W = 1 path (on
        CPU a batched matmul may reduce in a different order per batch size).
        Otherwise the rows go through one batched pass (fast mode)."""
        if not exact or tokens.shape[0] == 1:
            return self.forward(tokens, pos, cache)
        outs = [self.forward(tokens[i:i + 1], pos + i, cache) for i in range(tokens.shape[0])]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

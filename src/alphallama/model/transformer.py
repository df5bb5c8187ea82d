"""The reference transformer: every architecture of gguf.arch in one module, chosen by
the flags of ModelConfig and its Variant (biases, q/k norms, routed and shared experts,
rope layout and scaling, sliding windows, sinks, post norms, activations), never by name.

Float32 on CPU, weights dequantized once at load. The GPU runtime is checked against it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gguf.arch import ModelConfig
from ..kv_cache import KVCache
from .layers import ACTIVATIONS, apply_rope, attention, moe, rms_norm
from .rope import layer_tables


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_len: int):
        self.cfg = cfg
        self.w = weights
        self.max_len = max_len
        self.ropes = layer_tables(cfg, max_len, weights)          # per layer: cos/sin [max_len, rope_dim/2]
        self.cos, self.sin = self.ropes[cfg.n_layers - 1]          # a full-attention layer's (the MTP head's)
        self.output = weights.get("output.weight", weights["token_embd.weight"])   # [V, D] (tied if absent)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, c.n_kv_heads, max_len or self.max_len, c.head_dim)

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w[prefix + ".weight"], self.w.get(prefix + ".bias"))

    def _qkv(self, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        if c.variant.fused_qkv:
            return self._linear(h, p + "attn_qkv").split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
        return self._linear(h, p + "attn_q"), self._linear(h, p + "attn_k"), self._linear(h, p + "attn_v")

    def _attention(self, i: int, h: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        c, w, p, v = self.cfg, self.w, f"blk.{i}.", self.cfg.variant
        T = h.shape[0]
        q, k, val = self._qkv(h, p)                                              # [T, H*hd], [T, n_kv*hd] x2
        q = q.reshape(T, c.n_heads, c.head_dim)
        k = k.reshape(T, c.n_kv_heads, c.head_dim)
        val = val.reshape(T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], c.norm_eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], c.norm_eps)
        cos, sin = (t[pos:pos + T] for t in self.ropes[i])
        q = apply_rope(q, cos, sin, c.rope_neox)
        k = apply_rope(k, cos, sin, c.rope_neox)
        if v.attn_temp_scale:   # [T] llama4's query temperature, by absolute position
            p_ = torch.arange(pos, pos + T, dtype=torch.float64)
            q = q * (torch.log(torch.floor(p_ / v.attn_temp_floor) + 1) * v.attn_temp_scale + 1).float()[:, None, None]
        cache.k[i, :, pos:pos + T] = k.transpose(0, 1)                           # [n_kv, T, hd]
        cache.v[i, :, pos:pos + T] = val.transpose(0, 1)
        a = attention(q, cache.k[i, :, :pos + T], cache.v[i, :, :pos + T], pos,  # [T, H*hd]
                      v.attn_scale or None, v.sliding_window if v.is_swa(i) else 0, w.get(p + "attn_sinks.weight"))
        a = self._linear(a, p + "attn_output")
        return rms_norm(a, w[p + "post_attention_norm.weight"], c.norm_eps) if v.post_norms else a

    def _ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        c, w, p, v = self.cfg, self.w, f"blk.{i}.", self.cfg.variant
        if c.is_moe:
            bias = (lambda n: w[p + n + ".bias"]) if v.expert_bias else (lambda n: None)  # noqa: E731
            f = moe(h, w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"],
                    w[p + "ffn_down_exps.weight"], c.n_experts_used, c.norm_topk_prob, bias("ffn_gate_inp"),
                    v.moe_gating, (bias("ffn_gate_exps"), bias("ffn_up_exps"), bias("ffn_down_exps"))
                    if v.expert_bias else None, v.ffn_act)
            if v.shared_expert_ff:
                g = torch.sigmoid(h @ w[p + "ffn_gate_inp_shexp.weight"])[:, None]      # [T, 1]
                f = f + g * self._dense(h, p + "ffn_gate_shexp", p + "ffn_up_shexp", p + "ffn_down_shexp", "silu")
        elif v.fused_gate_up:
            gate, up = self._linear(h, p + "ffn_up").chunk(2, dim=-1)                  # [T, F] x2
            f = self._linear(ACTIVATIONS[v.ffn_act](gate, up), p + "ffn_down")
        else:
            f = self._dense(h, p + "ffn_gate", p + "ffn_up", p + "ffn_down", v.ffn_act)
        return rms_norm(f, w[p + "post_ffw_norm.weight"], c.norm_eps) if v.post_norms else f

    def _dense(self, h: torch.Tensor, gate: str, up: str, down: str, act: str) -> torch.Tensor:
        return self._linear(ACTIVATIONS[act](self._linear(h, gate), self._linear(h, up)), down)   # [T, D]

    def _layer(self, i: int, x: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        x = x + self._attention(i, rms_norm(x, w[p + "attn_norm.weight"], c.norm_eps), pos, cache)
        return x + self._ffn(i, rms_norm(x, w[p + c.variant.ffn_norm + ".weight"], c.norm_eps))

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
        if self.cfg.variant.embed_scale != 1.0:
            x = x * self.cfg.variant.embed_scale
        for i in range(self.cfg.n_layers):
            x = self._layer(i, x, pos, cache)
        cache.length = pos + T
        if not logits:
            return None, x
        h = rms_norm(x, self.w["output_norm.weight"], self.cfg.norm_eps)
        out = F.linear(h, self.output)                                            # [T, V]
        cap = self.cfg.variant.final_softcap
        return (torch.tanh(out / cap) * cap if cap else out), x

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

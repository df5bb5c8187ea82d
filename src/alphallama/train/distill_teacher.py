"""The frozen teacher for MTP distillation: a GGUF model as plain torch tensors on one
device (bf16 on the GPU), with a batched [B, T] forward.

The forward returns the last hidden state *before* the final norm (`h_p` of
docs/MTP.md, what the MTP head is fed), and `logits(h)` applies the final norm and the
output head. It is the reference transformer's arithmetic (`alphallama.model`) in
batched form: SDPA for attention, the same RoPE tables and layer order; a test checks
it against the reference on CPU at fp32.

Generation (`distill_generate.py`) runs left-padded batches through a `BatchCache`:
RoPE depends only on position differences, so every row uses the slot index as its
position and the padding is masked out of the keys.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..gguf.arch import ModelConfig, expected_tensors, load_config
from ..gguf.quants import as_bytes, dequantize
from ..gguf.reader import GGUFFile
from ..model.layers import apply_rope, moe, rms_norm, rope_tables


@dataclass
class BatchCache:
    """K/V of every layer for B rows: k, v [n_layers, B, n_kv, max_len, head_dim];
    `valid` [B, max_len] marks real (non-padding) keys; `length` rows are written."""
    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor
    length: int = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def load_teacher_weights(f: GGUFFile, cfg: ModelConfig, device: torch.device,
                         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the model, dequantized on `device` (the GPU does it in
    milliseconds) and stored as `dtype`; 1-D tensors (norms, biases) stay float32."""
    out = {}
    for name in expected_tensors(cfg):
        t = f.tensors[name]
        w = dequantize(as_bytes(t.data).to(device), t.qtype, t.shape)  # float32, t.shape
        out[name] = w if w.dim() == 1 else w.to(dtype)
    return out


class Teacher:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_len: int):
        self.cfg = cfg
        self.w = weights
        emb = weights["token_embd.weight"]
        self.device, self.dtype = emb.device, emb.dtype
        self.embedding = emb                                                   # [V, D]
        self.output = weights.get("output.weight", emb)                        # [V, D] (tied if absent)
        self.output_norm = weights["output_norm.weight"]                       # [D]
        cos, sin = rope_tables(max_len, cfg.rope_dim, cfg.rope_base)           # [max_len, rope_dim/2]
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.max_len = max_len

    @classmethod
    def from_gguf(cls, path: str, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.bfloat16, max_len: int = 4096) -> "Teacher":
        f = GGUFFile(path)
        cfg = load_config(f)
        return cls(cfg, load_teacher_weights(f, cfg, torch.device(device), dtype), max_len)

    def new_cache(self, batch: int, max_len: int) -> BatchCache:
        c = self.cfg
        shape = (c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim)
        return BatchCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(batch, max_len, dtype=torch.bool, device=self.device))

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        b = self.w.get(prefix + ".bias")
        return F.linear(x, self.w[prefix + ".weight"], None if b is None else b.to(x.dtype))

    def _attention(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, T, H, hd]; k, v [B, L, n_kv, hd]; mask None (causal, L = T) or
        [B, 1, group*T, L] from `_cache_mask` -> [B, T, H*hd]."""
        B, T, H, hd = q.shape
        n_kv = k.shape[2]
        group = H // n_kv
        q = q.transpose(1, 2)                                                  # [B, H, T, hd]
        k, v = k.transpose(1, 2), v.transpose(1, 2)                            # [B, n_kv, L, hd]
        if mask is None:   # whole rows: flash attention over K/V repeated per query head
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H, T, hd]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # [B, H, T, hd]
        else:              # over a cache: the heads sharing a kv head become rows (no K/V copies)
            qg = q.reshape(B, n_kv, group * T, hd)                             # [B, n_kv, group*T, hd]
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(B, H, T, hd)
        return out.transpose(1, 2).reshape(B, T, H * hd)

    def _cache_mask(self, cache: BatchCache, pos: int, T: int) -> torch.Tensor:
        """[B, 1, group*T, pos+T] bool: causal, padding keys masked. Each row always sees
        itself, so a padding row (all of whose earlier keys are padding) stays finite."""
        L = pos + T
        qpos = torch.arange(pos, L, device=self.device)                        # [T]
        kpos = torch.arange(L, device=self.device)                             # [L]
        own = kpos[None, :] == qpos[:, None]                                   # [T, L]
        mask = ((kpos[None, :] <= qpos[:, None]) & cache.valid[:, None, :L]) | own  # [B, T, L]
        group = self.cfg.n_heads // self.cfg.n_kv_heads
        B = mask.shape[0]
        return mask[:, None].expand(B, group, T, L).reshape(B, 1, group * T, L)

    def _layer(self, i: int, x: torch.Tensor, cache: BatchCache | None, pos: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        B, T, D = x.shape
        dt = self.dtype
        h = rms_norm(x, w[p + "attn_norm.weight"], c.norm_eps).to(dt)          # [B, T, D]
        q = self._linear(h, p + "attn_q").view(B, T, c.n_heads, c.head_dim)
        k = self._linear(h, p + "attn_k").view(B, T, c.n_kv_heads, c.head_dim)
        v = self._linear(h, p + "attn_v").view(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q.float(), w[p + "attn_q_norm.weight"], c.norm_eps)
            k = rms_norm(k.float(), w[p + "attn_k_norm.weight"], c.norm_eps)
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]                # [T, rope_dim/2]
        q = apply_rope(q.float(), cos, sin, c.rope_neox).to(dt)                # [B, T, H, hd]
        k = apply_rope(k.float(), cos, sin, c.rope_neox).to(dt)                # [B, T, n_kv, hd]
        if cache is not None:
            cache.k[i, :, :, pos:pos + T] = k.transpose(1, 2)
            cache.v[i, :, :, pos:pos + T] = v.transpose(1, 2)
            k = cache.k[i, :, :, :pos + T].transpose(1, 2)                      # [B, L, n_kv, hd]
            v = cache.v[i, :, :, :pos + T].transpose(1, 2)
        x = x + self._linear(self._attention(q, k, v, mask), p + "attn_output").float()
        h = rms_norm(x, w[p + "ffn_norm.weight"], c.norm_eps).to(dt)
        if c.is_moe:
            f = moe(h.reshape(B * T, D), w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_exps.weight"],
                    w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"],
                    c.n_experts_used, c.norm_topk_prob).view(B, T, D)
        else:
            g = F.silu(self._linear(h, p + "ffn_gate")) * self._linear(h, p + "ffn_up")  # [B, T, F]
            f = self._linear(g, p + "ffn_down")
        return x + f.float()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: BatchCache | None = None, pos: int = 0) -> torch.Tensor:
        """tokens [B, T] at positions pos..pos+T-1 -> h [B, T, D] float32, the last
        hidden state before the final norm. The residual stream is float32 (as the
        engine's); matrix products run in the weights' dtype. Without a cache: a plain
        causal pass over whole rows."""
        B, T = tokens.shape
        if pos + T > self.max_len:
            raise ValueError(f"positions up to {pos + T} exceed the teacher's {self.max_len}")
        if cache is not None:
            if pos != cache.length or pos + T > cache.max_len:
                raise ValueError(f"rows {pos}..{pos + T} do not continue a cache of "
                                 f"{cache.length}/{cache.max_len}")
        elif pos:
            raise ValueError("a forward without a cache starts at position 0")
        x = self.embedding[tokens].float()                                     # [B, T, D]
        mask = None if cache is None else self._cache_mask(cache, pos, T)
        for i in range(self.cfg.n_layers):
            x = self._layer(i, x, cache, pos, mask)
        if cache is not None:
            cache.length = pos + T
        return x

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The output head's input: final RMSNorm of h [..., D], in the weights' dtype."""
        return rms_norm(h.float(), self.output_norm, self.cfg.norm_eps).to(self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] (before the final norm) -> float32 logits [..., V]."""
        return F.linear(self.normed(h), self.output).float()

"""The hybrids' in-file MTP head (qwen35, qwen35moe, qwen3next; nextn_predict_layers = 1) on the
GPU runtime, beside GPUHybridModel: model/qwen35_mtp.py's math (llama.cpp's graph_mtp) on
GPUMTPHead's machinery (runtime/gpu_mtp.py: the static inputs, the extend / chain graphs per
width bucket and depth, the draft vocabulary's scored rows, the pick kernel, one host sync a
round). What differs is the block and what each depth is fed:

    depth 1:  g' = output_norm(h_{p-1})          (GPUMTPHead: h_{p-1} itself)
    depth k:  g' = shared_head_norm(h'_{k-1})    (GPUMTPHead: h'_{k-1})
    z  = eh_proj(cat([enorm(embed(x_p)), hnorm(g')]))          GPUMTPHead._project
    h' = z + gated_attention(attn_norm(z))                      hybrid_round.attention_rows
    h' = h' + ffn(post_attention_norm(h'))                      hybrid_round.ffn_rows
    logits = output(shared_head_norm(h'))

The block is built by build_hybrid_layer (a gated attention block: [q | k | v] and the query
gate split at load, q/k norms, the model's partial / sectioned rope) with K/V slot 0 of the
head's one-layer cache (slot = position), on fp32 GEMVs as GPUMTPHead's block is.
shared_head_norm(h') is kept in fp32: it is both the scored head's input and the next depth's g'.
"""
from __future__ import annotations

import torch

from ..gguf.arch import MTPHeadConfig
from ..kernels.norm.rmsnorm import add_rmsnorm
from ..kv_cache import KVCache
from ..model.qwen35 import hybrid_rope_tables
from .gpu_mtp import GPUMTPHead
from .hybrid_layers import HybridLayer, build_hybrid_layer
from .hybrid_round import attention_rows, ffn_rows


class GPUHybridMTPHead(GPUMTPHead):
    """GPUMTPHead's interface (new_cache, set_vocab, extend, draft, prepare) for GPUHybridModel."""

    def _load_block(self, t: dict, hc: MTPHeadConfig) -> HybridLayer:
        return build_hybrid_layer(t, hc.layer, self.cfg, self.device, "f32", "f32", attn_slot=0)

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return hybrid_rope_tables(n, self.cfg)                                    # [n, rope_dim / 2]

    def _entry(self, g: torch.Tensor) -> torch.Tensor:
        """Depth 1: the main model's hidden rows g [W, D] after its final norm (fp32)."""
        return add_rmsnorm(g, None, self.model.output_norm, self.cfg.norm_eps, torch.float32)

    def _block(self, gn: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
               cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at pos..pos+W-1 (pos int32 [1] on the device) from g' [W, D] fp32 and tokens [W]
        -> (shared_head_norm(h') [W, D] fp32: the next depth's g', and the same rows to score)."""
        c, L, act = self.cfg, self.layer, self.act_dtype
        x = self._project(gn, tokens)                                              # [W, D] fp32: z
        h = add_rmsnorm(x, None, L.attn_norm, c.norm_eps, act)
        a = attention_rows(self, L.mixer, h, pos, cache, self.model.attn_tiles)    # the model's tiles
        h = add_rmsnorm(x, a, L.ffn_norm, c.norm_eps, act)
        hn = add_rmsnorm(x, ffn_rows(self, L, h), self.head_norm, c.norm_eps, torch.float32)   # x += ffn: h'
        return hn, hn

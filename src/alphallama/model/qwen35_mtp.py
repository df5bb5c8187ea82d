"""The in-file MTP block of the hybrids (nextn_predict_layers = 1), as llama.cpp's
graph_mtp of src/models/qwen35*.cpp and qwen3next.cpp computes it; the engine's MTP
drafter (spec/mtp.py) drives it through MTPHead's interface.

It differs from docs/MTP.md's head in what it is fed and in its block:

    g'  = output_norm(h_{p-1})                 depth 1: the main model's hidden state after its final norm
    g'  = shared_head_norm(h'_{k-1})           depth k > 1: the previous entry's, after the head norm
    z   = eh_proj(cat([enorm(embed(x_p)), hnorm(g')]))
    h'  = z + gated_attention(attn_norm(z)) ;  h' = h' + ffn(post_attention_norm(h'))
    logits = output(shared_head_norm(h'))     (output_norm where the file has no shared_head_norm)

The block is a full-attention hybrid block (query gate, q/k norms, the model's rope) with
the model's FFN kind (dense, or routed + shared experts); its K/V cache is one layer with
slot = position, exactly as MTPHead's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DEFAULTS
from ..gguf.arch import MTPHeadConfig
from ..gguf.arch_qwen35 import hybrid_mtp_tensors
from ..gguf.quants import dequantize
from ..gguf.reader import GGUFFile
from ..kv_cache import KVCache
from .layers import rms_norm
from .mtp import MTPHead
from .qwen35 import HybridTransformer, gated_attention, hybrid_ffn, hybrid_rope_tables


class HybridMTPHead(MTPHead):
    def __init__(self, cfg, hc: MTPHeadConfig, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 output: torch.Tensor, output_norm: torch.Tensor, max_len: int):
        super().__init__(cfg, hc, weights, embed, output, max_len)
        self.cos, self.sin = hybrid_rope_tables(max_len + DEFAULTS.mtp.max_depth + 2, cfg)
        self.output_norm = output_norm
        self.head_norm = weights.get("nextn.shared_head_norm.weight", output_norm)

    @classmethod
    def load(cls, head_file: GGUFFile, hc: MTPHeadConfig, model: HybridTransformer, max_len: int) -> HybridMTPHead:
        weights = {}
        for name in hybrid_mtp_tensors(model.cfg, hc.layer):
            t = head_file.tensors[name]
            weights[name[len(hc.prefix):]] = dequantize(t.data, t.qtype, t.shape)
        return cls(model.cfg, hc, weights, model.w["token_embd.weight"], model.output,
                   model.w["output_norm.weight"], max_len)

    def _block(self, gn: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Entries at pos..pos+m-1 from normed inputs gn [m, D] -> h' [m, D]."""
        c, w = self.cfg, self.w
        e = rms_norm(self.embed[tokens], w["nextn.enorm.weight"], c.norm_eps)        # [m, D]
        h = rms_norm(gn, w["nextn.hnorm.weight"], c.norm_eps)                        # [m, D]
        x = F.linear(torch.cat([e, h], dim=-1), w["nextn.eh_proj.weight"])          # [m, D]
        a = gated_attention(c, w, "", rms_norm(x, w["attn_norm.weight"], c.norm_eps), pos, cache, 0,
                            self.cos, self.sin)
        x = x + a
        return x + hybrid_ffn(c, w, "", rms_norm(x, w["post_attention_norm.weight"], c.norm_eps))

    def block(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Depth 1: g is the main model's hidden state before its final norm."""
        return self._block(rms_norm(g, self.output_norm, self.cfg.norm_eps), tokens, pos, cache)

    def logits(self, hp: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hp, self.head_norm, self.cfg.norm_eps), self.scored)

    @torch.inference_mode()
    def draft(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, depth: int,
              cache: KVCache) -> tuple[list[int], list[float]]:
        """MTPHead.draft, with deeper entries fed the head-normed h' of the previous one."""
        hp = self.extend(g, tokens, pos, cache)[-1:]                                 # [1, D]
        p = pos + tokens.shape[0] - 1
        out, probs = [], []
        for k in range(depth):
            if k:
                gn = rms_norm(hp, self.head_norm, self.cfg.norm_eps)
                hp = self._block(gn, torch.tensor([out[-1]]), p + k, cache)           # [1, D]
            tok, pr = self._pick(self.logits(hp)[0])
            out.append(tok)
            probs.append(pr)
        return out, probs

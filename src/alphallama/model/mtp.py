"""The MTP head, reference version (float32 on CPU, plain PyTorch), per docs/MTP.md.

The entry at position p takes a hidden state g "for position p-1" and the token x_p:

    z  = eh_proj(cat([enorm(embed(x_p)), hnorm(g)]))       # [D]
    h' = block(z, position p)                               # one pre-norm layer over the MTP cache
    logits = output(shared_head_norm(h'))                   # predicts x_{p+1}

Depth 1 takes g = h_{p-1}, the main model's last hidden state before its output norm
(zeros at p = 0, as training does); depth k > 1 takes g = h' of the depth-(k-1) entry at
p-1 and the token that entry drafted. The block has its own one-layer KV cache with
slot = position: depth-1 entries of committed positions are permanent (`cache.length`
counts them); a draft chain writes its deeper entries past `length`, where the next
extend overwrites them. So a depth-k query at p sees depth-1 entries up to p-k+1 and
the chain's own entries after that, exactly the mask the head was trained with.

The embedding and the output head are the main model's. The head scores only the
output rows of `set_vocab` (the draft vocabulary, spec/draft_vocab.py): a draft is the
argmax over them and its probability the softmax over them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DEFAULTS
from ..gguf.arch import ModelConfig, MTPHeadConfig, mtp_tensors
from ..gguf.quants import dequantize
from ..gguf.reader import GGUFFile
from ..kv_cache import KVCache
from .layers import apply_rope, attention, moe, rms_norm, rope_tables, swiglu


class MTPHead:
    def __init__(self, cfg: ModelConfig, hc: MTPHeadConfig, weights: dict[str, torch.Tensor],
                 embed: torch.Tensor, output: torch.Tensor, max_len: int):
        """weights: the block's tensors by their name after `blk.L.` (float32);
        embed, output: the main model's [V, D] token embedding and output head."""
        self.cfg, self.hc, self.w = cfg, hc, weights
        self.embed, self.output = embed, output
        self.max_len = max_len
        # a chain runs up to max_depth positions past the last committed one
        self.cos, self.sin = rope_tables(max_len + DEFAULTS.mtp.max_depth + 2, cfg.rope_dim, cfg.rope_base)
        self.vocab_ids: torch.Tensor | None = None   # [S] scored rows; None = all
        self.scored = output                          # [S, D]

    @classmethod
    def load(cls, head_file: GGUFFile, hc: MTPHeadConfig, model, max_len: int) -> "MTPHead":
        """The block's tensors from `head_file` (the model file or a sidecar), dequantized;
        `model` is the reference Transformer whose embedding and head it shares."""
        weights = {}
        for name in mtp_tensors(model.cfg, hc.layer, hc.moe, hc.d_ff):
            t = head_file.tensors[name]
            weights[name[len(hc.prefix):]] = dequantize(t.data, t.qtype, t.shape)
        return cls(model.cfg, hc, weights, model.w["token_embd.weight"], model.output, max_len)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """Entries for positions 0..max_len (the token after a full context has one too),
        and room past them for a chain."""
        c = self.cfg
        n = (max_len or self.max_len) + 1
        cache = KVCache(1, c.n_kv_heads, n + DEFAULTS.mtp.max_depth, c.head_dim)
        cache.max_len = n
        return cache

    def new_caches(self, max_len: int | None = None, n: int = 1) -> list[KVCache]:
        """A cache for each of n engine slots (parallel streams): on the CPU one each, as the
        reference model's slots have (each stream's chain runs on its own)."""
        return [self.new_cache(max_len) for _ in range(n)]

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only these output rows (sorted token ids [S]); None: the whole vocabulary."""
        self.vocab_ids = None if ids is None else ids.to(torch.int64)
        self.scored = self.output if ids is None else self.output[self.vocab_ids]   # [S, D]

    # -- the block -------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def block(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Entries at positions pos..pos+m-1 from g [m, D] and tokens [m]: writes their K/V
        at those slots, attends to slots 0..p, returns h' [m, D] (before shared_head_norm)."""
        c, w = self.cfg, self.w
        m = tokens.shape[0]
        e = rms_norm(self.embed[tokens], w["nextn.enorm.weight"], c.norm_eps)       # [m, D]
        h = rms_norm(g, w["nextn.hnorm.weight"], c.norm_eps)                        # [m, D]
        x = F.linear(torch.cat([e, h], dim=-1), w["nextn.eh_proj.weight"])         # [m, D]
        h = rms_norm(x, w["attn_norm.weight"], c.norm_eps)
        q = self._linear(h, "attn_q").view(m, c.n_heads, c.head_dim)                # [m, H, hd]
        k = self._linear(h, "attn_k").view(m, c.n_kv_heads, c.head_dim)             # [m, n_kv, hd]
        v = self._linear(h, "attn_v").view(m, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, w["attn_q_norm.weight"], c.norm_eps)
            k = rms_norm(k, w["attn_k_norm.weight"], c.norm_eps)
        cos, sin = self.cos[pos:pos + m], self.sin[pos:pos + m]
        q = apply_rope(q, cos, sin, c.rope_neox)
        k = apply_rope(k, cos, sin, c.rope_neox)
        cache.k[0, :, pos:pos + m] = k.transpose(0, 1)                             # [n_kv, m, hd]
        cache.v[0, :, pos:pos + m] = v.transpose(0, 1)
        a = attention(q, cache.k[0, :, :pos + m], cache.v[0, :, :pos + m], pos)    # [m, H*hd]
        x = x + self._linear(a, "attn_output")
        h = rms_norm(x, w["ffn_norm.weight"], c.norm_eps)
        if self.hc.moe:
            f = moe(h, w["ffn_gate_inp.weight"], w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"],
                    w["ffn_down_exps.weight"], c.n_experts_used, c.norm_topk_prob)
        else:
            f = swiglu(h, w["ffn_gate.weight"], w["ffn_up.weight"], w["ffn_down.weight"])
        return x + f                                                                # [m, D]

    def logits(self, hp: torch.Tensor) -> torch.Tensor:
        """h' [m, D] -> logits over the scored rows [m, S]."""
        return F.linear(rms_norm(hp, self.w["nextn.shared_head_norm.weight"], self.cfg.norm_eps), self.scored)

    def _pick(self, logits: torch.Tensor) -> tuple[int, float]:
        """[S] -> (token id, its probability among the scored rows)."""
        p = torch.softmax(logits, -1)                                               # [S]
        i = int(p.argmax())
        tok = i if self.vocab_ids is None else int(self.vocab_ids[i])
        return tok, float(p[i])

    # -- what the engine and the drafter call ------------------------------------------
    @torch.inference_mode()
    def extend(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache) -> torch.Tensor:
        """Permanent depth-1 entries at positions pos..pos+m-1 (cache.length becomes pos+m);
        returns their h' [m, D]."""
        if pos > cache.length or pos + tokens.shape[0] > cache.max_len:
            raise ValueError(f"MTP entries {pos}..{pos + tokens.shape[0]} do not fit a cache of "
                             f"{cache.length}/{cache.max_len}")
        hp = self.block(g.float(), tokens, pos, cache)
        cache.length = pos + tokens.shape[0]
        return hp

    @torch.inference_mode()
    def draft(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, depth: int,
              cache: KVCache) -> tuple[list[int], list[float]]:
        """extend(g, tokens, pos), then a chain of `depth` drafts from the last entry:
        draft 1 from its logits, draft k from a depth-k entry (temporary, at the next
        position) fed h' of the previous one and the token it drafted."""
        hp = self.extend(g, tokens, pos, cache)[-1:]                                # [1, D]
        p = pos + tokens.shape[0] - 1
        out, probs = [], []
        for k in range(depth):
            if k:
                hp = self.block(hp, torch.tensor([out[-1]]), p + k, cache)          # [1, D]
            tok, pr = self._pick(self.logits(hp)[0])
            out.append(tok)
            probs.append(pr)
        return out, probs

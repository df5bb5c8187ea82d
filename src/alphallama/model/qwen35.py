"""The reference hybrid model: qwen3next, qwen35 and qwen35moe (gguf/arch_qwen35.py).

Layers are Gated DeltaNet (model/deltanet.py) or gated full attention, each followed by
a post-attention norm and a dense or MoE (+ shared expert) FFN; the math follows
llama.cpp's graphs (src/models/qwen35*.cpp, qwen3next.cpp, delta-net-base.cpp). Float32
on CPU, weights dequantized once at load, the same interface as model.transformer's
Transformer (new_cache, forward, verify) over a HybridCache.

RoPE: qwen3next rotates the first rope_dim dims NEOX-style. qwen35* use interleaved
M-RoPE; for text llama.cpp gives a token the position p in its first three sections and
0 in the fourth, so a rotated pair i turns by p * base^(-2i/rope_dim) unless its sector
(i mod the sections' sum) falls in the fourth section, where it does not turn.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gguf.arch_qwen35 import HybridConfig
from ..hybrid_cache import REPLAY, SNAPSHOT, HybridCache, State
from .deltanet import (
    RecurrentInputs,
    causal_conv,
    delta_rule,
    gates,
    key_heads,
    replay,
    split_qkv,
)
from .layers import apply_rope, attention, moe, rms_norm, swiglu


def imrope_turns(rope_dim: int, sections: tuple[int, ...]) -> torch.Tensor:
    """[rope_dim/2] bool: which pairs turn with a text token's position (interleaved
    M-RoPE: sector s of pair i = i mod sum(sections); s mod 3 picks the t/h/w section
    while s is below 3 * that section's size; the rest is the fourth section)."""
    n = sum(sections)
    out = []
    for i in range(rope_dim // 2):
        s = i % n
        out.append(s < 3 * sections[s % 3])
    return torch.tensor(out)


def hybrid_rope_tables(max_len: int, cfg: HybridConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, rope_dim/2] for text positions (float64, rounded once)."""
    inv = cfg.rope_base ** (-torch.arange(0, cfg.rope_dim, 2, dtype=torch.float64) / cfg.rope_dim)
    if cfg.rope_sections:
        inv = inv * imrope_turns(cfg.rope_dim, cfg.rope_sections)
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]       # [max_len, rope_dim/2]
    return ang.cos().float(), ang.sin().float()


def gated_attention(c: HybridConfig, w: dict[str, torch.Tensor], p: str, h: torch.Tensor, pos: int, cache,
                    slot: int, cos_t: torch.Tensor, sin_t: torch.Tensor) -> torch.Tensor:
    """Full attention of block p over rows pos..pos+T-1 (h: [T, D], normed): q/k norms, partial
    rope, K/V written to cache layer `slot`, the output times sigmoid(query gate)."""
    T, H, hd = h.shape[0], c.n_heads, c.head_dim
    qg = F.linear(h, w[p + "attn_q.weight"]).view(T, H, 2 * hd)             # [T, H, 2hd]: [q_h, gate_h]
    q, gate = qg[..., :hd], qg[..., hd:]
    k = F.linear(h, w[p + "attn_k.weight"]).view(T, c.n_kv_heads, hd)
    v = F.linear(h, w[p + "attn_v.weight"]).view(T, c.n_kv_heads, hd)
    q = rms_norm(q, w[p + "attn_q_norm.weight"], c.norm_eps)
    k = rms_norm(k, w[p + "attn_k_norm.weight"], c.norm_eps)
    cos, sin = cos_t[pos:pos + T], sin_t[pos:pos + T]
    q, k = apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True)
    cache.k[slot, :, pos:pos + T] = k.transpose(0, 1)                        # [n_kv, T, hd]
    cache.v[slot, :, pos:pos + T] = v.transpose(0, 1)
    a = attention(q, cache.k[slot, :, :pos + T], cache.v[slot, :, :pos + T], pos)  # [T, H*hd]
    a = a * torch.sigmoid(gate.reshape(T, H * hd))
    return F.linear(a, w[p + "attn_output.weight"])


def hybrid_ffn(c: HybridConfig, w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU, or routed experts (softmax, top-k renormalised) plus the gated shared expert."""
    if not c.is_moe:
        return swiglu(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
    f = moe(h, w[p + "ffn_gate_inp.weight"], w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"],
            w[p + "ffn_down_exps.weight"], c.n_experts_used, True)
    shared = swiglu(h, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return f + shared * torch.sigmoid(h @ w[p + "ffn_gate_inp_shexp.weight"])[:, None]


class HybridTransformer:
    def __init__(self, cfg: HybridConfig, weights: dict[str, torch.Tensor], max_len: int, state_mode: str = REPLAY):
        self.cfg = cfg
        self.w = weights
        self.max_len = max_len
        self.state_mode = state_mode
        self.cos, self.sin = hybrid_rope_tables(max_len, cfg)                      # [max_len, rope_dim/2]
        self.output = weights.get("output.weight", weights["token_embd.weight"])   # [V, D]
        self.kv_slot = {layer: j for j, layer in enumerate(cfg.attn_layers)}
        self.rec_slot = {layer: j for j, layer in enumerate(cfg.recurrent_layers)}
        self.k_head = key_heads(cfg.ssm_v_heads, cfg.ssm_k_heads, cfg.k_heads_tiled)   # [Hv]

    def new_cache(self, max_len: int | None = None) -> HybridCache:
        c = self.cfg
        return HybridCache(len(c.attn_layers), c.n_kv_heads, max_len or self.max_len, c.head_dim,
                           len(c.recurrent_layers), (c.conv_kernel - 1, c.conv_dim),
                           (c.ssm_v_heads, c.ssm_head_dim, c.ssm_head_dim), self._replay, self.state_mode)

    # -- layers --------------------------------------------------------------------
    def _attention(self, i: int, h: torch.Tensor, pos: int, cache: HybridCache) -> torch.Tensor:
        return gated_attention(self.cfg, self.w, f"blk.{i}.", h, pos, cache, self.kv_slot[i], self.cos, self.sin)

    def _beta_alpha(self, h: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        c, w = self.cfg, self.w
        if not c.fused_ba:
            return F.linear(h, w[p + "ssm_beta.weight"]), F.linear(h, w[p + "ssm_alpha.weight"])
        r = c.ssm_v_heads // c.ssm_k_heads
        ba = F.linear(h, w[p + "ssm_ba.weight"]).view(h.shape[0], c.ssm_k_heads, 2 * r)   # [T, Hk, 2r]
        return ba[..., :r].reshape(-1, c.ssm_v_heads), ba[..., r:].reshape(-1, c.ssm_v_heads)

    def _deltanet(self, i: int, h: torch.Tensor, cache: HybridCache, log: dict) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        T, Hv, dh = h.shape[0], c.ssm_v_heads, c.ssm_head_dim
        j = self.rec_slot[i]
        mix = F.linear(h, w[p + "attn_qkv.weight"])                                # [T, C]
        z = F.linear(h, w[p + "attn_gate.weight"]).view(T, Hv, dh)                 # [T, Hv, dv]
        b, a = self._beta_alpha(h, p)                                              # [T, Hv] each
        g, beta = gates(a, b, w[p + "ssm_dt.bias"], w[p + "ssm_a"])                # [T, Hv] each
        conv_in = cache.conv[j].clone()                                            # [d-1, C]
        xc, cache.conv[j] = causal_conv(mix, conv_in, w[p + "ssm_conv1d.weight"])  # [T, C]
        q, k, v = split_qkv(xc, c.ssm_k_heads, dh, self.k_head, c.norm_eps)       # [T, Hv, dk|dv]
        states: list[torch.Tensor] | None = [] if log["mode"] == SNAPSHOT else None
        o, cache.ssm[j] = delta_rule(q, k, v, g, beta, cache.ssm[j], states)
        if log["mode"] == SNAPSHOT:
            x = torch.cat([conv_in, mix])                                          # [d-1+T, C]
            log["conv"].append([x[t + 1:t + c.conv_kernel] for t in range(T)])     # per row [d-1, C]
            log["ssm"].append(states)
        elif log["mode"] == REPLAY:
            log["inputs"].append(RecurrentInputs(mix, q, k, v, g, beta))
        o = rms_norm(o, w[p + "ssm_norm.weight"], c.norm_eps) * F.silu(z)          # [T, Hv, dv]
        return F.linear(o.reshape(T, c.value_dim), w[p + "ssm_out.weight"])

    def _ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return hybrid_ffn(self.cfg, self.w, f"blk.{i}.", h)

    def _layer(self, i: int, x: torch.Tensor, pos: int, cache: HybridCache, log: dict) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"blk.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], c.norm_eps)                    # [T, D]
        if c.recurrent[i]:
            x = x + self._deltanet(i, h, cache, log)
        else:
            x = x + self._attention(i, h, pos, cache)
        return x + self._ffn(i, rms_norm(x, w[p + "post_attention_norm.weight"], c.norm_eps))

    # -- the model -------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos: int, cache: HybridCache,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run T rows at positions pos..pos+T-1 from the state at pos (Transformer.forward's
        contract); inside a verify round the rows' states are recorded in the cache."""
        T = tokens.shape[0]
        if pos > cache.length or pos + T > cache.max_len:
            raise ValueError(f"rows {pos}..{pos + T} do not fit a cache of {cache.length}/{cache.max_len}")
        cache.prepare(pos)
        log: dict = {"mode": cache.recording, "conv": [], "ssm": [], "inputs": []}
        x = self.w["token_embd.weight"][tokens]                                    # [T, D]
        for i in range(self.cfg.n_layers):
            x = self._layer(i, x, pos, cache, log)
        cache.length = pos + T
        if log["mode"] == SNAPSHOT:
            cache.record([(torch.stack([layer[t] for layer in log["conv"]]), torch.stack([layer[t] for layer in log["ssm"]]))
                          for t in range(T)], None)
        elif log["mode"] == REPLAY:
            cache.record(None, log["inputs"])
        if not logits:
            return None, x
        h = rms_norm(x, self.w["output_norm.weight"], self.cfg.norm_eps)
        return F.linear(h, self.output), x

    def verify(self, tokens: torch.Tensor, pos: int, cache: HybridCache, exact: bool = True):
        """A decode round over W rows (Transformer.verify's contract). Each row's state
        stays restorable until the engine truncates the cache to the accepted prefix."""
        cache.begin_round(pos)
        if not exact or tokens.shape[0] == 1:
            return self.forward(tokens, pos, cache)
        outs = [self.forward(tokens[i:i + 1], pos + i, cache) for i in range(tokens.shape[0])]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def _replay(self, forwards: list[list[RecurrentInputs]], n: int, pre: State) -> State:
        """The state after the first n rows of a round, recomputed from the state before it."""
        convs, ssms = [], []
        for j in range(len(self.cfg.recurrent_layers)):
            parts = [fw[j] for fw in forwards]
            cat = parts[0] if len(parts) == 1 else RecurrentInputs(
                *(torch.cat([getattr(x, f) for x in parts]) for f in ("mix", "q", "k", "v", "g", "beta")))
            conv, ssm = replay(cat, n, pre[0][j], pre[1][j])
            convs.append(conv)
            ssms.append(ssm)
        return torch.stack(convs), torch.stack(ssms)

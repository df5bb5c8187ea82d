"""What an architecture changes about the base llama/qwen block, as data.

`Variant` holds every departure the reference model implements (RoPE scaling,
sliding-window layers, attention sinks, GeGLU, post norms, fused projections, the MoE
gating variants, a shared expert, ...). Each architecture's reader turns a file's
metadata into one; `arch.ARCHS` names the reader per architecture. The model code
reads the flags, never the architecture name. Keys and defaults follow llama.cpp
(src/llama-model.cpp, src/models/<arch>.cpp, src/llama-context.cpp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

from .reader import GGUFError

# --- the flags ------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """llama.cpp's rope scaling (llama-context.cpp, ggml rope_yarn), as the metadata says."""
    kind: str = "none"          # none | linear | yarn | longrope (rope.scaling.type)
    factor: float = 1.0         # rope.scaling.factor (freq_scale = 1 / factor)
    orig_ctx: int = 0           # rope.scaling.original_context_length (0: the training context)
    attn_factor: float = 1.0    # rope.scaling.attn_factor
    beta_fast: float = 32.0     # YaRN ramp bounds
    beta_slow: float = 1.0
    yarn_log_mul: float = 0.0   # rope.scaling.yarn_log_multiplier (mscale_all_dims)


@dataclass(frozen=True)
class Variant:
    rope: RopeScaling = RopeScaling()
    rope_factors: tuple[str, ...] = ()   # per-pair frequency divisors: (rope_freqs,) or (long, short) tensor names
    sliding_window: int = 0              # n_swa: a SWA layer sees keys p - n_swa < k <= p
    swa_layers: tuple[bool, ...] = ()    # per layer: sliding-window attention
    rope_base_swa: float = 0.0           # rope base of the SWA layers
    rope_swa_scaled: bool = False        # SWA layers keep the rope scaling (gpt-oss); else freq_scale 1 (gemma3)
    attn_scale: float = 0.0              # q.k scale; 0: 1/sqrt(head_dim)
    attn_temp_scale: float = 0.0         # llama4/mistral3 query temperature: 1 + s*log(floor(p/floor)+1)
    attn_temp_floor: int = 0
    attn_sinks: bool = False             # blk.N.attn_sinks: one extra logit per head in the softmax
    attn_out_bias: bool = False
    fused_qkv: bool = False              # blk.N.attn_qkv: q, k, v in one matrix
    embed_scale: float = 1.0             # token embeddings times this (gemma: sqrt(d_model))
    post_norms: bool = False             # post_attention_norm / post_ffw_norm on each branch output
    ffn_norm: str = "ffn_norm"           # the pre-FFN norm's tensor (gpt-oss: post_attention_norm)
    ffn_act: str = "silu"                # model.layers.ACTIVATIONS key
    fused_gate_up: bool = False          # ffn_up holds [gate; up] (phi3)
    final_softcap: float = 0.0           # logits = c * tanh(logits / c)
    moe_gating: str = "softmax"          # softmax over all experts, or softmax_weight: over the chosen k
    expert_bias: bool = False            # router and expert biases (gpt-oss)
    shared_expert_ff: int = 0            # a sigmoid-gated shared expert of this width (qwen2moe)

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]


# --- reading the metadata -------------------------------------------------------

@dataclass(frozen=True)
class Meta:
    md: dict[str, Any]
    arch: str
    path: str
    n_layers: int
    tensors: dict | None = None

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.md

    def int(self, key: str, default: int, lo: int = 0) -> int:
        from .arch import _int
        return _int(self.md, f"{self.arch}.{key}", self.path, default, lo)

    def float(self, key: str, default: float, positive: bool = True) -> float:
        v = self.md.get(f"{self.arch}.{key}", default)
        if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0) or v < 0:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} = {v!r} is not a "
                            f"{'positive' if positive else 'non-negative'} number")
        return float(v)

    def tensor(self, name: str) -> bool:
        return self.tensors is not None and name in self.tensors


_ROPE_KINDS = ("none", "linear", "yarn", "longrope")


def read_rope(m: Meta) -> tuple[RopeScaling, tuple[str, ...]]:
    """rope.scaling.* as llama.cpp reads them (a missing type is linear, a missing factor 1)."""
    kind = m.md.get(f"{m.arch}.rope.scaling.type", "linear")
    if kind not in _ROPE_KINDS:
        raise GGUFError(f"{m.path}: rope scaling {kind!r} is not supported (supported: {', '.join(_ROPE_KINDS)})")
    key = "rope.scaling.factor" if m.has("rope.scaling.factor") else "rope.scale_linear"
    factor = m.float(key, 0.0, positive=False) or 1.0
    rope = RopeScaling(
        kind="none" if kind == "linear" and factor == 1.0 else kind, factor=factor,
        orig_ctx=m.int("rope.scaling.original_context_length", m.int("context_length", 2048, 1)),
        attn_factor=m.float("rope.scaling.attn_factor", 1.0),
        beta_fast=m.float("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=m.float("rope.scaling.yarn_beta_slow", 1.0),
        yarn_log_mul=m.float("rope.scaling.yarn_log_multiplier", 0.0, positive=False))
    if kind == "longrope":
        factors = tuple(n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if m.tensor(n))
        if len(factors) != 2:
            raise GGUFError(f"{m.path}: longrope scaling needs rope_factors_long and rope_factors_short")
    else:
        factors = ("rope_freqs.weight",) if m.tensor("rope_freqs.weight") else ()
    return rope, factors


def swa_pattern(m: Meta, default_pattern: int) -> tuple[bool, ...]:
    """Which layers slide: attention.sliding_window_pattern as an array of bools, or as a
    period n (layer i slides unless i % n == n - 1), llama.cpp's set_swa_pattern."""
    v = m.md.get(f"{m.arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(v, list):
        if len(v) < m.n_layers or any(type(b) not in (bool, int) for b in v):
            raise GGUFError(f"{m.path}: {m.arch}.attention.sliding_window_pattern is not one flag per layer")
        return tuple(bool(b) for b in v[:m.n_layers])
    if type(v) is not int or v < 0:
        raise GGUFError(f"{m.path}: {m.arch}.attention.sliding_window_pattern = {v!r} is not a period")
    return tuple(v == 0 or i % v < v - 1 for i in range(m.n_layers))


def base(m: Meta) -> Variant:
    """llama, qwen2, qwen3, qwen3moe: the base block, with the file's rope scaling."""
    rope, factors = read_rope(m)
    return Variant(rope=rope, rope_factors=factors)


def mistral3(m: Meta) -> Variant:
    """llama's block, YaRN with its beta/log-multiplier keys, and the query temperature."""
    v = base(m)
    temp = m.float("attention.temperature_scale", 0.0, positive=False)
    return replace(v, attn_temp_scale=temp, attn_temp_floor=v.rope.orig_ctx if temp else 0)


def gemma3(m: Meta) -> Variant:
    """sqrt(d) embedding scale, GeGLU, post norms (the converter stores 1 + w), q/k norms,
    sliding-window layers (period 6) with their own unscaled rope base, optional softcap."""
    v = base(m)
    window = m.int("attention.sliding_window", 0)
    d, n_heads, hd = m.int("embedding_length", 0, 1), m.int("attention.head_count", 0, 1), \
        m.int("attention.key_length", 256, 1)
    # gemma_pytorch's query_pre_attn_scalar: head_dim, except the 27B (62 layers): d / n_heads
    scale = 1.0 / math.sqrt(d / n_heads if m.n_layers == 62 else hd)
    v = replace(v, embed_scale=math.sqrt(d), post_norms=True, ffn_act="gelu", attn_scale=scale,
                final_softcap=m.float("final_logit_softcapping", 0.0, positive=False))
    if window > 0:
        v = replace(v, sliding_window=window, swa_layers=swa_pattern(m, 6),
                    rope_base_swa=m.float("rope.freq_base_swa", 10000.0))
    return v


def gpt_oss(m: Meta) -> Variant:
    """Attention sinks, sliding window on alternate layers (period 2), q/k/v/o biases,
    a router with a bias choosing k experts whose logits are then softmaxed, biased
    experts with the clamped SwiGLU (alpha 1.702, limit 7), YaRN."""
    v = base(m)
    window = m.int("attention.sliding_window", 0, lo=1)
    return replace(v, sliding_window=window, swa_layers=swa_pattern(m, 2), attn_sinks=True, attn_out_bias=True,
                   rope_base_swa=m.float("rope.freq_base_swa", m.float("rope.freq_base", 10000.0)),
                   rope_swa_scaled=True,
                   ffn_norm="post_attention_norm", ffn_act="swiglu_oai", moe_gating="softmax_weight",
                   expert_bias=True)


def phi3(m: Meta) -> Variant:
    """Fused q/k/v and gate/up projections; longrope factors (long past the original
    context). llama.cpp ignores phi3's sliding window (disabled there), and so do we."""
    return replace(base(m), fused_qkv=m.tensor("blk.0.attn_qkv.weight"), fused_gate_up=True)


def qwen2moe(m: Meta) -> Variant:
    """qwen2's attention; routed experts without renormalisation plus a shared expert
    gated by sigmoid(w . x)."""
    return replace(base(m), shared_expert_ff=m.int("expert_shared_feed_forward_length",
                                                   m.int("feed_forward_length", 0)))


Reader = Callable[[Meta], Variant]


# --- tensors the variant adds, and what the GPU runtime cannot do yet -----------

def variant_tensors(cfg, i: int, moe: bool) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(tensors block i adds, tensors it drops) relative to arch.layer_tensors' base list."""
    v: Variant = cfg.variant
    D, Q, KV, H, p = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.n_heads, f"blk.{i}."
    add: dict[str, tuple[int, ...]] = {}
    drop: set[str] = set()
    if v.fused_qkv:
        drop |= {p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"}
        add[p + "attn_qkv.weight"] = (Q + 2 * KV, D)
    if v.attn_sinks:
        add[p + "attn_sinks.weight"] = (H,)
    if v.attn_out_bias:
        add[p + "attn_output.bias"] = (D,)
    if v.post_norms:
        add |= {p + "post_attention_norm.weight": (D,), p + "post_ffw_norm.weight": (D,)}
    if v.ffn_norm != "ffn_norm":
        drop.add(p + "ffn_norm.weight")
        add[p + v.ffn_norm + ".weight"] = (D,)
    if v.fused_gate_up and not moe:
        drop.add(p + "ffn_gate.weight")
        add[p + "ffn_up.weight"] = (2 * cfg.d_ff, D)
    if moe and v.expert_bias:
        E, F = cfg.n_experts, cfg.d_ff_expert
        add |= {p + "ffn_gate_inp.bias": (E,), p + "ffn_gate_exps.bias": (E, F), p + "ffn_up_exps.bias": (E, F),
                p + "ffn_down_exps.bias": (E, D)}
    if moe and v.shared_expert_ff:
        S = v.shared_expert_ff
        add |= {p + "ffn_gate_inp_shexp.weight": (D,), p + "ffn_gate_shexp.weight": (S, D),
                p + "ffn_up_shexp.weight": (S, D), p + "ffn_down_shexp.weight": (D, S)}
    return add, drop


def global_tensors(cfg) -> dict[str, tuple[int, ...]]:
    return {name: (cfg.rope_dim // 2,) for name in cfg.variant.rope_factors}


def gpu_departures(cfg) -> list[str]:
    """What the GPU runtime (runtime/gpu_model.py) does not implement for this model. Every
    flag above runs there now (gpt-oss's sinks, o bias, pre-FFN norm, swiglu_oai, gating and
    expert biases included: decisions/architectures.md); what a new flag value would need:"""
    v = cfg.variant
    # the gated activations of kernels/activations/silu.ACT_IDS (dense FFNs and the MoE kernels
    # alike); the gatings of kernels/moe/route.py
    checks = [(v.ffn_act not in ("silu", "gelu", "swiglu_oai"), f"{v.ffn_act} FFN"),
              (v.moe_gating not in ("softmax", "softmax_weight"), f"{v.moe_gating} expert gating")]
    return [what for bad, what in checks if bad]


__all__ = ["Meta", "Reader", "RopeScaling", "Variant", "base", "gemma3", "global_tensors", "gpt_oss",
           "gpu_departures", "mistral3", "phi3", "qwen2moe", "read_rope", "swa_pattern", "variant_tensors"]

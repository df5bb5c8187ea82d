"""RoPE tables as llama.cpp computes them (ggml's rope_yarn and llama-context.cpp's
attention factor): linear and YaRN scaling, per-pair frequency divisors (Llama 3.1's
rope_freqs, phi3's longrope factors) and the magnitude scale folded into cos/sin.
"""
from __future__ import annotations

import math

import torch

from ..gguf.arch import ModelConfig
from ..gguf.arch_variants import RopeScaling
from .layers import rope_tables


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def _corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The pair range over which YaRN ramps from extrapolation to interpolation."""
    def dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def scaled_tables(max_len: int, n_dims: int, base: float, rope: RopeScaling, scaled: bool = True,
                  factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_len, n_dims/2] (float32, computed in float64), magnitude scale included.

    scaled=False: the layer's rope is unscaled (freq_scale 1) but keeps the file's
    YaRN extrapolation setting and attention factor, as llama.cpp's SWA layers do."""
    if rope.kind == "none" and factors is None and rope.attn_factor == 1.0:
        return rope_tables(max_len, n_dims, base)       # the plain tables, bit for bit
    freq_scale = 1.0 / rope.factor if rope.kind != "none" else 1.0
    ext = 1.0 if rope.kind == "yarn" else 0.0
    attn = 1.0
    if ext:
        f = 1.0 / freq_scale
        attn = _mscale(f, 1.0) / _mscale(f, rope.yarn_log_mul) if rope.yarn_log_mul else _mscale(f, 1.0)
        attn /= 1.0 + 0.1 * math.log(f)    # cancels the factor ggml's rope_yarn multiplies back in
    attn *= rope.attn_factor
    if not scaled:
        freq_scale = 1.0
    half = n_dims // 2
    i = torch.arange(half, dtype=torch.float64)                                    # [half]
    inv = base ** (-2.0 * i / n_dims)                                              # [half]
    if factors is not None:
        inv = inv / factors.double()
    extrap = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]   # [max_len, half]
    theta = freq_scale * extrap
    mscale = attn
    if ext:
        lo, hi = _corr_dims(n_dims, rope.orig_ctx, base, rope.beta_fast, rope.beta_slow)
        ramp = (1 - ((i - lo) / max(0.001, hi - lo)).clamp(0, 1)) * ext           # [half]
        theta = theta * (1 - ramp) + extrap * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
    return (theta.cos() * mscale).float(), (theta.sin() * mscale).float()


def layer_tables(cfg: ModelConfig, max_len: int, weights: dict[str, torch.Tensor], ctx: int | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (cos, sin) [max_len, rope_dim/2] per layer; layers that share a table share the
    tensors. longrope takes its long factors when the context (ctx, default max_len: a
    runtime's tables may run past its context) exceeds the original one."""
    v = cfg.variant
    factors = None
    if v.rope_factors:
        long = (max_len if ctx is None else ctx) > v.rope.orig_ctx
        name = v.rope_factors[0] if len(v.rope_factors) == 1 or long else v.rope_factors[1]
        factors = weights[name]
    full = scaled_tables(max_len, cfg.rope_dim, cfg.rope_base, v.rope, True, factors)
    if not v.sliding_window:
        return [full] * cfg.n_layers
    swa = scaled_tables(max_len, cfg.rope_dim, v.rope_base_swa, v.rope, v.rope_swa_scaled, factors)
    return [swa if v.is_swa(i) else full for i in range(cfg.n_layers)]

"""Synthetic Gated-DeltaNet hybrids (qwen3next, qwen35, qwen35moe): the spec's extra
shape, the metadata keys convert_hf_to_gguf writes for them, the values of the tensors
that are neither matrices nor norms, and the presets (tiny ones for CI, the
Qwen3.6-35B-A3B-like shape for the GPU).

Values are chosen for a sane recurrence: ssm_a = -exp(A_log) around -e (decay rates of
~0.05-0.5 a token with dt around 0.05, as HF's init gives), dt biases near
softplus^-1(0.05), the shared expert's gate vector like a matrix row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .arch_qwen35 import HybridConfig, hybrid_mtp_tensors
from .synth_spec import SyntheticSpec, _preset

_SSM_A = (-2.7, 0.4)        # ssm_a = -exp(A_log): mean, std (6.7 sigma from 0)
_DT_BIAS = (-3.0, 0.5)      # softplus(-3) ~ 0.05


@dataclass(frozen=True)
class HybridSpec(SyntheticSpec):
    conv_kernel: int = 4
    ssm_head_dim: int = 32          # ssm.state_size (key = value head dim)
    ssm_k_heads: int = 2            # ssm.group_count
    ssm_v_heads: int = 4            # ssm.time_step_rank
    full_attention_interval: int = 4
    rope_dim: int = 0               # rotated dims per attention head; 0: head_dim // 4 (partial_rotary_factor 0.25)
    rope_sections: tuple[int, ...] = ()   # qwen35*: M-RoPE sections (written as given); () for qwen3next
    d_ff_shared: int = 0            # MoE: the shared expert's width

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim // 4

    def extend_config(self, cfg: Any) -> HybridConfig:
        qwen35 = self.arch != "qwen3next"
        cfg = replace(cfg, rope_dim=self.n_rot, norm_topk_prob=True)
        return HybridConfig(
            **{k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
            conv_kernel=self.conv_kernel, ssm_head_dim=self.ssm_head_dim, ssm_k_heads=self.ssm_k_heads,
            ssm_v_heads=self.ssm_v_heads,
            recurrent=tuple((i + 1) % self.full_attention_interval != 0 for i in range(self.n_layers)),
            rope_sections=tuple(self.rope_sections) + (0,) * (4 - len(self.rope_sections)) if self.rope_sections else (),
            d_ff_shared=self.d_ff_shared if cfg.is_moe else 0, k_heads_tiled=qwen35, fused_ba=not qwen35)

    def add_metadata(self, w: Any) -> None:
        w.add_ssm_conv_kernel(self.conv_kernel)
        w.add_ssm_state_size(self.ssm_head_dim)
        w.add_ssm_group_count(self.ssm_k_heads)
        w.add_ssm_time_step_rank(self.ssm_v_heads)
        w.add_ssm_inner_size(self.ssm_head_dim * self.ssm_v_heads)
        w.add_full_attention_interval(self.full_attention_interval)
        w.add_rope_dimension_count(self.n_rot)
        if self.rope_sections:
            w.add_rope_dimension_sections(list(self.rope_sections))
        if self.d_ff_shared:
            w.add_expert_shared_feed_forward_length(self.d_ff_shared)

    def init_override(self, name: str) -> tuple[float, float] | None:
        if name.endswith(".ssm_a"):
            return _SSM_A
        if name.endswith(".ssm_dt.bias"):
            return _DT_BIAS
        if name.endswith(".ffn_gate_inp_shexp.weight"):
            return 0.0, self.d_model ** -0.5
        return None

    def mtp_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        return hybrid_mtp_tensors(cfg, self.n_layers)


# Tiny: 4 layers (three DeltaNet, one attention), rows of 256 for the k-quants.
_TINY = dict(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, ctx_len=2048,
             vocab_size=512, conv_kernel=4, ssm_head_dim=32, ssm_k_heads=2, ssm_v_heads=4)
_TINY_MOE = dict(n_experts=8, n_experts_used=2, d_ff_expert=256, d_ff_shared=256)


def _tiny(arch: str, **kw: Any) -> Callable[..., SyntheticSpec]:
    return _preset(HybridSpec(arch=arch, name=f"tiny-{arch}", **(_TINY | kw)))


HYBRID_PRESETS: dict[str, Callable[..., SyntheticSpec]] = {
    # plain partial NEOX rope (16 of 64 dims), tied head
    "tiny-qwen3next": _tiny("qwen3next", tied_embeddings=True, **_TINY_MOE),
    # Qwen3.5's own section split [11, 11, 10] scaled to 8 pairs
    "tiny-qwen35": _tiny("qwen35", rope_sections=(3, 3, 2, 0)),
    # sections that leave pair 5 in the fourth (position 0 for text) section
    "tiny-qwen35moe": _tiny("qwen35moe", rope_sections=(2, 2, 1, 1), **_TINY_MOE),
    # Qwen3.6-35B-A3B-like: 40 layers, every 4th full attention (16 q heads, 2 kv heads, head dim 256,
    # 64 rotated), DeltaNet with 16 key / 32 value heads of 128, 256 experts of 512 (8 used) + a
    # shared expert of 512, one MTP block, vocab 248320
    "qwen36-35b-a3b": _preset(HybridSpec(
        arch="qwen35moe", name="qwen36-35b-a3b", n_layers=40, d_model=2048, n_heads=16, n_kv_heads=2,
        head_dim=256, d_ff=512, n_experts=256, n_experts_used=8, d_ff_expert=512, d_ff_shared=512,
        ctx_len=262144, vocab_size=248320, conv_kernel=4, ssm_head_dim=128, ssm_k_heads=16, ssm_v_heads=32,
        rope_sections=(11, 11, 10, 0), rope_base=1e7, mtp="moe"), quant="Q4_K_M"),
}

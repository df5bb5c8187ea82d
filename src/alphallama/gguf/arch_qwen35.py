"""The Gated-DeltaNet hybrids: `qwen3next`, `qwen35` (dense) and `qwen35moe`.

Layers alternate between recurrent (Gated DeltaNet) and full attention; llama.cpp's
names and keys (src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp, llama-arch.cpp):

    {arch}.ssm.conv_kernel      d_conv: the causal conv1d window over the q/k/v mix
    {arch}.ssm.state_size       head dim of the recurrence (keys and values alike)
    {arch}.ssm.group_count      key heads Hk;   {arch}.ssm.time_step_rank: value heads Hv
    {arch}.ssm.inner_size       Hv * state_size
    {arch}.full_attention_interval (default 4) or {arch}.attention.recurrent_layers [bool]
    {arch}.rope.dimension_sections  qwen35*: interleaved M-RoPE sections (text: see model/)

Every layer is pre-norm (attn_norm) with a post-attention norm before its FFN. Attention
layers have a query gate (attn_q holds [q_h, gate_h] per head), q/k norms and partial
RoPE; recurrent layers have attn_qkv (the conv input), attn_gate (z, the output gate),
ssm_conv1d, ssm_dt.bias, ssm_a (= -exp(A_log)), beta/alpha projections (qwen35: ssm_beta
and ssm_alpha; qwen3next: ssm_ba, [beta, alpha] interleaved per key head), ssm_norm and
ssm_out. MoE layers add a shared expert with a sigmoid gate (ffn_gate_inp_shexp).

The two families broadcast key heads to value heads differently: qwen35 tiles them
(value head j reads key head j % Hk), qwen3next repeats each (j // (Hv / Hk)).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .arch import ArchSpec, ModelConfig, _int, layer_tensors
from .reader import GGUFError


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    """A ModelConfig with the recurrent layers' shape (the reference model reads these)."""
    conv_kernel: int = 0               # d_conv
    ssm_head_dim: int = 0              # state_size: key and value head dim of the recurrence
    ssm_k_heads: int = 0               # group_count (Hk)
    ssm_v_heads: int = 0               # time_step_rank (Hv)
    recurrent: tuple[bool, ...] = ()   # per main layer: True = Gated DeltaNet, False = attention
    rope_sections: tuple[int, ...] = ()  # qwen35*: 4 M-RoPE sections; () = plain NEOX rope
    d_ff_shared: int = 0               # shared expert width (MoE hybrids), 0 = none
    k_heads_tiled: bool = True         # value head j reads key head j % Hk (else j // (Hv/Hk))
    fused_ba: bool = False             # qwen3next: one ssm_ba tensor instead of ssm_beta + ssm_alpha

    @property
    def key_dim(self) -> int:
        return self.ssm_k_heads * self.ssm_head_dim

    @property
    def value_dim(self) -> int:
        return self.ssm_v_heads * self.ssm_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if not r]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.recurrent) if r]


def _recurrent_flags(md: dict[str, Any], arch: str, n_layers: int, n_blocks: int, path: str) -> tuple[bool, ...]:
    flags = md.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != n_blocks or any(type(f) is not bool for f in flags):
            raise GGUFError(f"{path}: {arch}.attention.recurrent_layers must be {n_blocks} booleans")
        return tuple(flags[:n_layers])
    every = _int(md, f"{arch}.full_attention_interval", path, 4)
    return tuple((i + 1) % every != 0 for i in range(n_layers))


def _sections(md: dict[str, Any], arch: str, path: str, required: bool) -> tuple[int, ...]:
    s = md.get(f"{arch}.rope.dimension_sections")
    if s is None:
        if required:
            raise GGUFError(f"{path}: metadata key {arch}.rope.dimension_sections is missing")
        return ()
    if not isinstance(s, list) or not 1 <= len(s) <= 4 or any(type(v) is not int or v < 0 for v in s) \
            or sum(s[:3]) == 0:
        raise GGUFError(f"{path}: {arch}.rope.dimension_sections = {s!r} is not 1..4 non-negative integers")
    return tuple(s) + (0,) * (4 - len(s))


def hybrid_config(cfg: ModelConfig, md: dict[str, Any], path: str) -> HybridConfig:
    """The hybrid part of the metadata on top of the common ModelConfig."""
    arch = cfg.arch
    g = lambda k, d=None, lo=1: _int(md, f"{arch}.{k}", path, d, lo)  # noqa: E731
    qwen35 = arch != "qwen3next"
    base = {f.name: getattr(cfg, f.name) for f in fields(ModelConfig)}
    base["norm_topk_prob"] = True      # llama.cpp renormalises these archs' top-k weights always
    h = HybridConfig(
        **base,
        conv_kernel=g("ssm.conv_kernel"), ssm_head_dim=g("ssm.state_size"),
        ssm_k_heads=g("ssm.group_count"), ssm_v_heads=g("ssm.time_step_rank"),
        recurrent=_recurrent_flags(md, arch, cfg.n_layers, cfg.n_layers + cfg.n_nextn, path),
        rope_sections=_sections(md, arch, path, required=qwen35),
        d_ff_shared=(g("expert_shared_feed_forward_length", 0, lo=0) or cfg.d_ff) if cfg.is_moe else 0,
        k_heads_tiled=qwen35, fused_ba=not qwen35)
    inner = g("ssm.inner_size")
    if inner != h.value_dim or h.ssm_v_heads % h.ssm_k_heads or h.conv_kernel < 2:
        raise GGUFError(f"{path}: inconsistent recurrent shape: inner_size {inner}, state_size {h.ssm_head_dim}, "
                        f"{h.ssm_k_heads} key heads, {h.ssm_v_heads} value heads, conv kernel {h.conv_kernel} "
                        f"(needs inner_size = value heads * state_size, value heads a multiple of key heads, "
                        f"a kernel of at least 2)")
    if sum(h.rope_sections) > h.rope_dim // 2 and h.rope_sections:
        raise GGUFError(f"{path}: rope sections {list(h.rope_sections)} cover more than {h.rope_dim // 2} pairs")
    if cfg.is_moe and h.d_ff_shared < 1:
        raise GGUFError(f"{path}: {arch} needs expert_shared_feed_forward_length (or feed_forward_length)")
    if not cfg.is_moe and cfg.d_ff < 1:
        raise GGUFError(f"{path}: {arch} needs feed_forward_length")
    return h


# --- tensors ----------------------------------------------------------------------

def _attention(h: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    D, Q, KV, H = h.d_model, h.q_dim, h.kv_dim, h.head_dim
    return {p + "attn_q.weight": (2 * Q, D), p + "attn_k.weight": (KV, D), p + "attn_v.weight": (KV, D),
            p + "attn_output.weight": (D, Q), p + "attn_q_norm.weight": (H,), p + "attn_k_norm.weight": (H,)}


def _deltanet(h: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    D, Hv = h.d_model, h.ssm_v_heads
    ba = ({p + "ssm_ba.weight": (2 * Hv, D)} if h.fused_ba
          else {p + "ssm_beta.weight": (Hv, D), p + "ssm_alpha.weight": (Hv, D)})
    return {p + "attn_qkv.weight": (h.conv_dim, D), p + "attn_gate.weight": (h.value_dim, D),
            p + "ssm_conv1d.weight": (h.conv_dim, h.conv_kernel), p + "ssm_dt.bias": (Hv,),
            p + "ssm_a": (Hv,)} | ba | {p + "ssm_norm.weight": (h.ssm_head_dim,),
                                        p + "ssm_out.weight": (D, h.value_dim)}


def _ffn(h: HybridConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The FFN of block i (dense, or routed experts plus the gated shared expert)."""
    p, D = f"blk.{i}.", h.d_model
    routed = {n: s for n, s in layer_tensors(h, i, h.is_moe, h.d_ff).items() if "ffn_" in n and "norm" not in n}
    if not h.is_moe:
        return routed
    S = h.d_ff_shared
    return routed | {p + "ffn_gate_inp_shexp.weight": (D,), p + "ffn_gate_shexp.weight": (S, D),
                     p + "ffn_up_shexp.weight": (S, D), p + "ffn_down_shexp.weight": (D, S)}


def block_tensors(h: HybridConfig, i: int, recurrent: bool) -> dict[str, tuple[int, ...]]:
    p, D = f"blk.{i}.", h.d_model
    mixer = _deltanet(h, p) if recurrent else _attention(h, p)
    return {p + "attn_norm.weight": (D,)} | mixer | {p + "post_attention_norm.weight": (D,)} | _ffn(h, i)


def hybrid_tensors(h: HybridConfig) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (h.vocab_size, h.d_model),
                                       "output_norm.weight": (h.d_model,)}
    if not h.tied_embeddings:
        out["output.weight"] = (h.vocab_size, h.d_model)
    for i, r in enumerate(h.recurrent):
        out |= block_tensors(h, i, r)
    return out


NEXTN_OWN = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


def hybrid_mtp_tensors(h: HybridConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The in-file MTP block (blk.L, L = n_layers): a full-attention block plus the nextn
    projections; the output head and embedding are the model's."""
    D, p = h.d_model, f"blk.{layer}."
    own = {p + NEXTN_OWN[0]: (D, 2 * D), p + NEXTN_OWN[1]: (D,), p + NEXTN_OWN[2]: (D,), p + NEXTN_OWN[3]: (D,)}
    return block_tensors(h, layer, recurrent=False) | own


HYBRID_ARCHS = (
    ArchSpec("qwen3next", rope_neox=True, qk_norm=True, moe=True, hybrid=hybrid_config, tensors=hybrid_tensors),
    ArchSpec("qwen35", rope_neox=True, qk_norm=True, hybrid=hybrid_config, tensors=hybrid_tensors),
    ArchSpec("qwen35moe", rope_neox=True, qk_norm=True, moe=True, hybrid=hybrid_config, tensors=hybrid_tensors),
)

"""Tiny synthetic presets of the architectures in arch_variants: each switches on its
architecture's departures (scaled rope, sliding windows, sinks, fused projections, a
shared expert, ...) at sizes llama.cpp's CPU build runs in a second. Windows and
original contexts are short so that a 72-token run crosses them."""
from __future__ import annotations

from typing import Any, Callable


def arch_presets(preset: Callable[..., Callable[..., Any]], tiny: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    from .synth_spec import SyntheticSpec

    def spec(name: str, arch: str, **kw: Any) -> Callable[..., Any]:
        return preset(SyntheticSpec(arch=arch, **(tiny | {"name": name} | kw)))

    moe = dict(n_experts=4, n_experts_used=2, d_ff_expert=256)
    return {
        # Llama 3.1: per-pair frequency divisors in rope_freqs (the llama3 rule, factor 8)
        "tiny-llama31": spec("tiny-llama31", "llama", rope_base=500000.0, norm_eps=1e-5,
                             rope_factors=("rope_freqs.weight",)),
        "tiny-llama-yarn": spec("tiny-llama-yarn", "llama", rope_base=10000.0, norm_eps=1e-5, extra_md={
            "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 256}),
        "tiny-llama-linear": spec("tiny-llama-linear", "llama", rope_base=10000.0, norm_eps=1e-5, extra_md={
            "rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
        # six layers: five sliding (window 16, base 1e4) and one global (base 1e6); softcap exercised.
        # Untied: with random weights a tied head repeats the last token (the real 270M is tied)
        "tiny-gemma3": spec("tiny-gemma3", "gemma3", n_layers=6, extra_md={
            "attention.sliding_window": 16, "final_logit_softcapping": 30.0}),
        "tiny-gpt-oss": spec("tiny-gpt-oss", "gpt-oss", rope_base=150000.0, norm_eps=1e-5, **moe, extra_md={
            "attention.sliding_window": 16, "rope.scaling.type": "yarn", "rope.scaling.factor": 8.0,
            "rope.scaling.original_context_length": 64}),
        # longrope: llama.cpp takes the long factors when the context (256 here) exceeds 64; a
        # general.name with "phi3" in it would make llama.cpp look for Phi-3's special tokens
        "tiny-phi3": spec("tiny-phi-mini", "phi3", rope_base=10000.0, norm_eps=1e-5, n_kv_heads=4, fused_qkv=True,
                          rope_factors=("rope_factors_long.weight", "rope_factors_short.weight"), extra_md={
                              "rope.scaling.type": "longrope", "rope.scaling.attn_factor": 1.25,
                              "rope.scaling.original_context_length": 64}),
        "tiny-mistral3": spec("tiny-mistral3", "mistral3", norm_eps=1e-5, extra_md={
            "rope.scaling.type": "yarn", "rope.scaling.factor": 16.0, "rope.scaling.original_context_length": 16,
            "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
            "rope.scaling.yarn_log_multiplier": 1.0, "attention.temperature_scale": 0.5}),
        "tiny-qwen2moe": spec("tiny-qwen2moe", "qwen2moe", **moe, extra_md={
            "expert_shared_feed_forward_length": 512}),
    }

"""llama.cpp's quant mixes (src/llama-quant.cpp, llama_tensor_get_type: the version vendored in
llama-cpp-python 0.3.36) for the synthetic writer: which type each tensor group of each layer
gets under a file type, without an importance matrix. The rules kept are those that touch the
tensors our architectures have; a "blk.N.<group>" key overrides a group for one layer.

Shared rules: the output head (and token_embd when it is the output head) gets Q6_K (Q5_K in
the IQ3_XXS-and-below mixes); "ffn_down" names the dense, routed and shared down projections
alike (llama.cpp matches the substring); attn_qkv is the fused projection's (and the hybrids'
DeltaNet in-projection's) category. Models of exactly 8 experts (Mixtral) get their own rules.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as T

# the groups a mix names (synth_spec.QUANT_GROUPS lists them all)
DOWNS = ("ffn_down", "ffn_down_exps", "ffn_down_shexp")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers that get more bits in a _M mix: the first and
    last eighth, and every third layer in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def uniform_mix(groups: tuple[str, ...], qtype: T) -> dict[str, T]:
    """Every quantizable tensor in one type (llama-quantize --pure)."""
    return {g: qtype for g in groups}


def _per_layer(mix: dict[str, T], groups: tuple[str, ...], n_layers: int, pick) -> None:
    """mix["blk.i.g"] = pick(i) for every layer and group, where pick gives a type (None: leave)."""
    for i in range(n_layers):
        t = pick(i)
        if t is not None:
            for g in groups:
                mix[f"blk.{i}.{g}"] = t


def _head(mix: dict[str, T], head: T, tied: bool) -> None:
    mix["output"] = head
    if tied:
        mix["embd"] = head


def q4_k_m_mix(groups: tuple[str, ...], n_layers: int, tied: bool, n_experts: int, gqa: int) -> dict[str, T]:
    """Q4_K everywhere; Q6_K for the head and for attn_v and ffn_down in the use_more_bits
    layers; Q5_K for attn_qkv. 8 experts: Q8_0 attn_k / attn_v and Q5_K attn_output."""
    mix = uniform_mix(groups, T.Q4_K) | {"attn_qkv": T.Q5_K}
    _head(mix, T.Q6_K, tied)
    _per_layer(mix, ("attn_v", *DOWNS), n_layers, lambda i: T.Q6_K if use_more_bits(i, n_layers) else None)
    if n_experts == 8:
        mix = {k: v for k, v in mix.items() if not k.endswith("attn_v")}
        mix |= {"attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K}
    return mix


def q3_k_m_mix(groups: tuple[str, ...], n_layers: int, tied: bool, n_experts: int, gqa: int) -> dict[str, T]:
    """Q3_K everywhere; Q6_K head; attn_v Q5_K in its first two layers then Q4_K; ffn_down
    Q5_K in the first sixteenth then Q4_K; attn_output and attn_qkv Q4_K."""
    mix = uniform_mix(groups, T.Q3_K) | {"attn_v": T.Q4_K, "attn_output": T.Q4_K, "attn_qkv": T.Q4_K}
    mix |= {g: T.Q4_K for g in DOWNS}
    _head(mix, T.Q6_K, tied)
    _per_layer(mix, ("attn_v",), n_layers, lambda i: T.Q5_K if i < 2 else None)
    _per_layer(mix, DOWNS, n_layers, lambda i: T.Q5_K if i < n_layers // 16 else None)
    if n_experts == 8:
        mix = {k: v for k, v in mix.items() if not k.endswith(("attn_v", "attn_output"))}
        mix |= {"attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K}
    return mix


def iq4_xs_mix(groups: tuple[str, ...], n_layers: int, tied: bool, n_experts: int, gqa: int) -> dict[str, T]:
    """IQ4_XS everywhere; Q6_K head; attn_v Q5_K where 4+ query heads share a key head;
    ffn_down Q5_K in the first eighth."""
    mix = uniform_mix(groups, T.IQ4_XS)
    _head(mix, T.Q6_K, tied)
    if gqa >= 4:
        mix["attn_v"] = T.Q5_K
    _per_layer(mix, DOWNS, n_layers, lambda i: T.Q5_K if i < n_layers // 8 else None)
    if n_experts == 8:
        mix = {k: v for k, v in mix.items() if not k.endswith("attn_v")}
        mix |= {"attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K}
    return mix


def iq3_xxs_mix(groups: tuple[str, ...], n_layers: int, tied: bool, n_experts: int, gqa: int) -> dict[str, T]:
    """IQ3_XXS everywhere; Q5_K head, IQ3_S token_embd; attn_q / attn_k IQ2_S; attn_v Q4_K
    where 4+ query heads share a key head (else IQ3_S); ffn_down Q4_K in the first eighth then
    Q3_K; attn_output IQ3_S."""
    mix = uniform_mix(groups, T.IQ3_XXS) | {"embd": T.IQ3_S, "attn_q": T.IQ2_S, "attn_k": T.IQ2_S,
                                            "attn_v": T.Q4_K if gqa >= 4 else T.IQ3_S, "attn_output": T.IQ3_S}
    mix |= {g: T.Q3_K for g in DOWNS}
    _head(mix, T.Q5_K, tied)
    _per_layer(mix, DOWNS, n_layers, lambda i: T.Q4_K if i < n_layers // 8 else None)
    if n_experts == 8:
        mix = {k: v for k, v in mix.items() if not k.endswith(("attn_k", "attn_v", "attn_output"))}
        mix |= {"attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q5_K}
    return mix

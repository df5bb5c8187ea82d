"""The synthetic model's tensors: the plan (every tensor llama.cpp loads, in writing
order, with its final type) and each tensor's seeded values.

Weights are sized for a sane forward pass at any depth: matrices have std
1/sqrt(fan_in) (so a normalised input gives outputs of RMS ~1), norms are 1 plus a
little noise. Every tensor has its own generator seeded from (seed, tensor name):
the same spec always gives the same bytes, and a tensor's values do not depend on
the tensors before it.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from .arch import ARCHS, ModelConfig, expected_tensors, mtp_tensors
from .arch_variants import Meta, Variant
from .quants import dequantize, quant_type, random_blocks
from .synth_spec import QUANT_GROUPS, SyntheticSpec

NORM_NOISE = 0.02   # norm weights are 1 + this * N(0, 1)
BIAS_STD = 0.02
_SAMPLE_BLOCKS = 512   # blocks dequantized to measure a quantized tensor's RMS (to ~1%)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]   # torch order, last dim = row
    qtype: T
    std: float               # values are mean + std * noise
    mean: float = 0.0        # 1 for norm weights; quantized tensors are always centred

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


# llama.cpp's tensor_type_fallback: a row length the block size does not divide gets
# a type with 32-value blocks; if that does not fit either, F16.
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


# 1-D tensors that are not norm weights: their (mean, std). The rope factor tensors are
# positive frequency divisors (rope_freqs is replaced by the llama3 rule in tensor_data).
_VECTORS = {
    "attn_sinks": lambda cfg: (0.0, 1.0),
    "ffn_gate_inp_shexp": lambda cfg: (0.0, 1.0 / math.sqrt(cfg.d_model)),
    "rope_freqs": lambda cfg: (1.0, 0.0),
    "rope_factors_long": lambda cfg: (3.0, 0.5),
    "rope_factors_short": lambda cfg: (1.2, 0.05),
}


# --- the tensor plan --------------------------------------------------------------

def model_config(spec: SyntheticSpec, n_vocab: int) -> ModelConfig:
    """The ModelConfig the reader will derive from the written file."""
    if spec.arch not in ARCHS:
        raise ValueError(f"architecture {spec.arch!r} is not supported (supported: {', '.join(ARCHS)})")
    a = ARCHS[spec.arch]
    if a.moe and not (0 < spec.n_experts_used <= spec.n_experts and spec.d_ff_expert > 0):
        raise ValueError(f"{spec.arch} needs n_experts, n_experts_used (1..n_experts) and d_ff_expert")
    if spec.n_heads % spec.n_kv_heads or spec.head_dim % 2:
        raise ValueError(f"bad attention shape: {spec.n_heads} heads, {spec.n_kv_heads} kv heads, "
                         f"head_dim {spec.head_dim}")
    return spec.extend_config(ModelConfig(
        variant=_variant(spec, a),
        arch=spec.arch, n_layers=spec.n_layers, d_model=spec.d_model, n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, d_ff=spec.d_ff, vocab_size=n_vocab,
        ctx_len=spec.ctx_len, norm_eps=_as_f32(spec.norm_eps), rope_base=_as_f32(spec.rope_base),
        rope_dim=spec.head_dim, rope_neox=a.rope_neox, qkv_bias=a.qkv_bias, qk_norm=a.qk_norm,
        n_experts=spec.n_experts if a.moe else 0, n_experts_used=spec.n_experts_used if a.moe else 0,
        d_ff_expert=spec.d_ff_expert if a.moe else 0, tied_embeddings=spec.tied_embeddings,
        n_nextn=1 if spec.mtp else 0, norm_topk_prob=a.norm_topk))


def _variant(spec: SyntheticSpec, a) -> Variant:
    """The Variant the architecture's reader derives from the metadata this spec writes
    (the keys the readers consult, float32 where the file stores float32)."""
    keys = {"embedding_length": spec.d_model, "attention.head_count": spec.n_heads,
            "attention.key_length": spec.head_dim, "context_length": spec.ctx_len, "feed_forward_length": spec.d_ff,
            "rope.freq_base": _as_f32(spec.rope_base)}
    keys |= {k: _as_f32(v) if type(v) is float else v for k, v in spec.extra_md.items()}
    present = set(spec.rope_factors) | ({"blk.0.attn_qkv.weight"} if spec.fused_qkv else set())
    return a.reader(Meta({f"{spec.arch}.{k}": v for k, v in keys.items()}, spec.arch, "<synthetic spec>",
                         spec.n_layers, dict.fromkeys(present)))


def _mtp_shapes(spec: SyntheticSpec, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    if spec.mtp not in ("dense", "moe"):
        raise ValueError(f"mtp must be None, 'dense' or 'moe', not {spec.mtp!r}")
    own = spec.mtp_shapes(cfg)
    if own is not None:
        return own
    return mtp_tensors(cfg, spec.n_layers, spec.mtp == "moe", spec.mtp_d_ff or spec.d_ff)


def _as_f32(x: float) -> float:
    """The value a float32 metadata key reads back as."""
    return float(np.float32(x))


def _group(name: str) -> tuple[str, int | None]:
    """'blk.3.attn_v.weight' -> ('attn_v', 3); 'token_embd.weight' -> ('embd', None)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return parts[2], int(parts[1])
    return ("embd" if parts[0] == "token_embd" else parts[0]), None


def _fitting(qtype: T, row: int) -> T:
    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, T.F16)
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


def _check_quant_keys(spec: SyntheticSpec) -> None:
    for key in spec.quant:
        group = key.split(".", 2)[2] if key.startswith("blk.") and key.count(".") >= 2 else key
        if group not in QUANT_GROUPS:
            raise ValueError(f"quant key {key!r} names no quantizable tensor group "
                             f"(groups: {', '.join(QUANT_GROUPS)}, or blk.N.<group>)")


def plan_tensors(spec: SyntheticSpec, n_vocab: int, sidecar: bool = False) -> list[PlannedTensor]:
    """Every tensor of the file in writing order, with its final type (after llama.cpp's
    fallback for rows a block size does not divide). sidecar: only the MTP head's."""
    _check_quant_keys(spec)
    cfg = model_config(spec, n_vocab)
    shapes = {} if sidecar else expected_tensors(cfg)
    if spec.mtp or sidecar:   # after the main blocks, as llama.cpp numbers it
        shapes |= _mtp_shapes(spec, cfg)
    # convert_hf_to_gguf order: embedding, the blocks, then the output norm and head
    first = ["token_embd.weight"]
    blocks = [n for n in shapes if n.startswith("blk.")]   # already in layer order
    names = [n for n in first if n in shapes] + blocks
    names += [n for n in shapes if n not in first and not n.startswith("blk.")]
    plan = []
    for name in names:
        shape = shapes[name]
        group, layer = _group(name)
        override = spec.init_override(name)
        if override is not None:
            plan.append(PlannedTensor(name, shape, T.F32, override[1], mean=override[0]))
        elif name.endswith(".bias"):
            plan.append(PlannedTensor(name, shape, T.F32, BIAS_STD))
        elif group in _VECTORS:   # vectors that are not norms: (mean, std) by role
            mean, std = _VECTORS[group](cfg)
            plan.append(PlannedTensor(name, shape, T.F32, std, mean=mean))
        elif len(shape) == 1:   # norm weights
            plan.append(PlannedTensor(name, shape, T.F32, NORM_NOISE, mean=1.0))
        else:   # matrices: outputs of RMS ~1 for inputs of RMS ~1
            qtype = T.F32   # the MoE router (not a quant group) stays F32
            if group in QUANT_GROUPS:
                wanted = spec.quant.get(f"blk.{layer}.{group}", spec.quant.get(group, T.F32))
                qtype = _fitting(T(wanted), shape[-1])
            plan.append(PlannedTensor(name, shape, qtype, 1.0 / math.sqrt(shape[-1])))
    return plan


# --- tensor values ----------------------------------------------------------------

def llama3_rope_freqs(n_dims: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                      old_ctx: int = 8192) -> torch.Tensor:
    """Llama 3.1's rope frequency divisors [n_dims/2] (float32), as its converter computes
    them: 1 for short wavelengths, `factor` for long ones, smooth in between."""
    freqs = base ** (-torch.arange(0, n_dims, 2, dtype=torch.float64) / n_dims)   # [n_dims/2]
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < old_ctx / high, torch.ones_like(freqs),
                      torch.where(wavelen > old_ctx / low, torch.full_like(freqs, factor), mid))
    return out.float()


_TORCH_FLOAT = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def _generator(seed: int, name: str) -> torch.Generator:
    # a stable hash (Python's hash() is salted per process)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _scaled_blocks(qtype: T, n_blocks: int, std: float, g: torch.Generator) -> torch.Tensor:
    """Random blocks rescaled to RMS `std`: every value of a block is linear in its fp16
    scale fields (d, and dmin or m), so scaling those scales the block."""
    blocks = random_blocks(qtype, n_blocks, g)  # [n_blocks, type_size]
    q = quant_type(qtype)
    sample = blocks[:_SAMPLE_BLOCKS]
    values = dequantize(sample, qtype, (sample.shape[0] * q.block_size,))  # [n_sample * block_size]
    factor = std / max(float(values.double().square().mean().sqrt()), 1e-30)
    for off in q.f16_fields:
        d = blocks[:, off:off + 2].contiguous().view(torch.float16)  # [n_blocks, 1]
        blocks[:, off:off + 2] = (d.float() * factor).to(torch.float16).view(torch.uint8)  # [n_blocks, 2]
    return blocks


def tensor_data(spec: SyntheticSpec, t: PlannedTensor) -> np.ndarray:
    """The stored bytes of one planned tensor (uint8 [nbytes]); the same for the same seed."""
    g = _generator(spec.seed, t.name)
    n = math.prod(t.shape)
    if t.name == "rope_freqs.weight":
        return llama3_rope_freqs(2 * n, spec.rope_base).numpy().view(np.uint8)  # [nbytes]
    if t.qtype in _TORCH_FLOAT:
        x = t.mean + t.std * torch.randn(n, generator=g)  # [n]
        return x.to(_TORCH_FLOAT[t.qtype]).view(torch.uint8).numpy()  # [nbytes]
    n_blocks = n // GGML_QUANT_SIZES[t.qtype][0]
    return _scaled_blocks(t.qtype, n_blocks, t.std, g).numpy().reshape(-1)  # [nbytes]

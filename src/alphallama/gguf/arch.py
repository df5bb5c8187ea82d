"""Architecture table: GGUF metadata -> ModelConfig, and the tensors each architecture
must provide (llama.cpp names, torch-order shapes).

Adding an architecture is one `ArchSpec` entry in `ARCHS`; the model code reads only
the flags of `ModelConfig`, never the architecture name.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from . import arch_variants as av
from .arch_variants import Variant
from .reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int                      # dense FFN width (0 when every layer is MoE)
    vocab_size: int
    ctx_len: int
    norm_eps: float
    rope_base: float
    rope_dim: int                  # rotated dims per head (<= head_dim)
    rope_neox: bool                # True: rotate halves (Qwen); False: adjacent pairs (llama)
    qkv_bias: bool = False         # qwen2
    qk_norm: bool = False          # qwen3, qwen3moe
    n_experts: int = 0             # 0 = dense model
    n_experts_used: int = 0
    d_ff_expert: int = 0
    norm_topk_prob: bool = True    # renormalise the top-k router weights to sum to 1
    tied_embeddings: bool = False  # no output.weight: the output head is token_embd
    n_nextn: int = 0               # MTP blocks in the file after the main layers (nextn_predict_layers)
    variant: Variant = Variant()   # the architecture's departures from the base block (arch_variants)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class ArchSpec:
    name: str
    rope_neox: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    # non-transformer layers (arch_qwen35): the config beyond ModelConfig's fields, and the tensor list
    hybrid: Callable[[ModelConfig, dict[str, Any], str], ModelConfig] | None = None
    tensors: Callable[[ModelConfig], dict[str, tuple[int, ...]]] | None = None
    reader: av.Reader = av.base    # metadata -> Variant
    norm_topk: bool = True         # default of expert_weights_norm (llama.cpp's norm_w)


ARCHS: dict[str, ArchSpec] = {a.name: a for a in (
    ArchSpec("llama", rope_neox=False),
    ArchSpec("qwen2", rope_neox=True, qkv_bias=True),
    ArchSpec("qwen3", rope_neox=True, qk_norm=True),
    ArchSpec("qwen3moe", rope_neox=True, qk_norm=True, moe=True),
    ArchSpec("gemma3", rope_neox=True, qk_norm=True, reader=av.gemma3),
    ArchSpec("gpt-oss", rope_neox=True, qkv_bias=True, moe=True, reader=av.gpt_oss, norm_topk=False),
    ArchSpec("phi3", rope_neox=True, reader=av.phi3),
    ArchSpec("mistral3", rope_neox=False, reader=av.mistral3),
    ArchSpec("qwen2moe", rope_neox=True, qkv_bias=True, moe=True, reader=av.qwen2moe, norm_topk=False),
)}


def _get(md: dict[str, Any], key: str, path: str, default: Any = None) -> Any:
    if key in md:
        return md[key]
    if default is None:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return default


def _int(md: dict[str, Any], key: str, path: str, default: int | None = None, lo: int = 1) -> int:
    """An integer hyperparameter, at least `lo`: a string, float, bool or array under an
    integer key (a corrupt type field) is named, never passed to int()."""
    v = _get(md, key, path, default)
    if type(v) is not int or v < lo:
        raise GGUFError(f"{path}: metadata {key} = {v!r} is not an integer >= {lo}")
    return v


def _float(md: dict[str, Any], key: str, path: str, default: float) -> float:
    """A positive finite float hyperparameter (integers are accepted: some converters write them)."""
    v = _get(md, key, path, default)
    if type(v) not in (int, float) or not 0 < v < math.inf:
        raise GGUFError(f"{path}: metadata {key} = {v!r} is not a positive number")
    return float(v)


def config_from_metadata(md: dict[str, Any], tensors: dict[str, Any] | None = None,
                         path: str = "<gguf>") -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHS))})")
    spec = ARCHS[arch]
    g = lambda k, d=None, lo=1: _int(md, f"{arch}.{k}", path, d, lo)  # noqa: E731
    d_model = g("embedding_length")
    n_heads = g("attention.head_count")
    n_kv = g("attention.head_count_kv", n_heads)
    head_dim = g("attention.key_length", max(d_model // n_heads, 1))
    # llama.cpp counts MTP ("nextn") blocks in block_count, after the main layers
    n_nextn = g("nextn_predict_layers", 0, lo=0)
    n_blocks = g("block_count")
    if not n_nextn < n_blocks:
        raise GGUFError(f"{path}: {arch}.nextn_predict_layers = {n_nextn} but block_count = {n_blocks}")
    if tensors is not None and n_blocks > len(tensors):   # each block has several tensors
        raise GGUFError(f"{path}: {arch}.block_count = {n_blocks} but the file has only {len(tensors)} tensors")
    vocab = md.get("tokenizer.ggml.tokens")
    if tensors is not None and "token_embd.weight" in tensors:
        n_vocab = tensors["token_embd.weight"].shape[0]
    elif isinstance(vocab, list):
        n_vocab = len(vocab)
    else:
        n_vocab = int(g("vocab_size"))
    cfg = ModelConfig(
        arch=arch,
        n_layers=n_blocks - n_nextn,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=g("feed_forward_length", 0, lo=0),
        vocab_size=int(n_vocab),
        ctx_len=g("context_length", 2048),
        norm_eps=_float(md, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-6),
        rope_base=_float(md, f"{arch}.rope.freq_base", path, 10000.0),
        rope_dim=g("rope.dimension_count", head_dim, lo=0),
        rope_neox=spec.rope_neox,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        n_experts=g("expert_count", 0, lo=0) if spec.moe else 0,
        n_experts_used=g("expert_used_count", 0, lo=0) if spec.moe else 0,
        d_ff_expert=g("expert_feed_forward_length", 0, lo=0) if spec.moe else 0,
        norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", spec.norm_topk)),
        tied_embeddings=tensors is not None and "output.weight" not in tensors,
        n_nextn=n_nextn,
        variant=spec.reader(av.Meta(md, arch, path, n_blocks - n_nextn, tensors)),
    )
    if spec.moe and not (cfg.n_experts > 0 and 0 < cfg.n_experts_used <= cfg.n_experts
                         and cfg.d_ff_expert > 0):
        raise GGUFError(f"{path}: {arch} needs expert_count, expert_used_count (1..expert_count) "
                        f"and expert_feed_forward_length in its metadata")
    if n_heads % n_kv or cfg.rope_dim > head_dim or cfg.rope_dim % 2:
        raise GGUFError(f"{path}: inconsistent attention shape: {n_heads} heads, {n_kv} kv heads, "
                        f"head_dim {head_dim}, rope dims {cfg.rope_dim}")
    return spec.hybrid(cfg, md, path) if spec.hybrid is not None else cfg


def layer_tensors(cfg: ModelConfig, i: int, moe: bool, d_ff: int) -> dict[str, tuple[int, ...]]:
    """The tensors of block i: attention as the architecture has it, then a dense
    SwiGLU FFN of width d_ff or (moe) the model's routed experts."""
    D, Q, KV, H = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    p = f"blk.{i}."
    out: dict[str, tuple[int, ...]] = {
        p + "attn_norm.weight": (D,),
        p + "attn_q.weight": (Q, D),
        p + "attn_k.weight": (KV, D),
        p + "attn_v.weight": (KV, D),
        p + "attn_output.weight": (D, Q),
        p + "ffn_norm.weight": (D,),
    }
    if cfg.qkv_bias:
        out |= {p + "attn_q.bias": (Q,), p + "attn_k.bias": (KV,), p + "attn_v.bias": (KV,)}
    if cfg.qk_norm:
        out |= {p + "attn_q_norm.weight": (H,), p + "attn_k_norm.weight": (H,)}
    if moe:
        E, F = cfg.n_experts, cfg.d_ff_expert
        out |= {
            p + "ffn_gate_inp.weight": (E, D),
            p + "ffn_gate_exps.weight": (E, F, D),
            p + "ffn_up_exps.weight": (E, F, D),
            p + "ffn_down_exps.weight": (E, D, F),
        }
    else:
        out |= {p + "ffn_gate.weight": (d_ff, D), p + "ffn_up.weight": (d_ff, D),
                p + "ffn_down.weight": (D, d_ff)}
    add, drop = av.variant_tensors(cfg, i, moe)
    return {k: s for k, s in out.items() if k not in drop} | add


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, name -> torch-order shape ([out, in] for matrices)."""
    if ARCHS[cfg.arch].tensors is not None:
        return ARCHS[cfg.arch].tensors(cfg)
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, cfg.d_model),
        "output_norm.weight": (cfg.d_model,),
    }
    if not cfg.tied_embeddings:
        out["output.weight"] = (cfg.vocab_size, cfg.d_model)
    out |= av.global_tensors(cfg)
    for i in range(cfg.n_layers):
        out |= layer_tensors(cfg, i, cfg.is_moe, cfg.d_ff)
    return out


def check_shapes(expected: dict[str, tuple[int, ...]], tensors: dict, what: str) -> None:
    """Every expected tensor present with its shape, else one GGUFError naming the first few."""
    problems = []
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(t.shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise GGUFError(f"{what} is malformed: " + "; ".join(problems[:3]) + more)


def load_config(f: GGUFFile) -> ModelConfig:
    """Config of a model file, after checking every expected tensor is there with its shape."""
    cfg = config_from_metadata(f.metadata, f.tensors, f.path)
    check_shapes(expected_tensors(cfg), f.tensors, f"{f.path}: {cfg.arch} model")
    return cfg


# --- the MTP head (docs/MTP.md) ------------------------------------------------------

MTP_OWN = ("nextn.enorm.weight", "nextn.hnorm.weight", "nextn.eh_proj.weight", "nextn.shared_head_norm.weight")
SIDECAR_SUFFIX = ".mtp.gguf"
# hyperparameters a sidecar must share with its model: (metadata key, ModelConfig field)
_SHARED_KEYS = (("embedding_length", "d_model"), ("attention.head_count", "n_heads"),
                ("attention.head_count_kv", "n_kv_heads"), ("attention.key_length", "head_dim"),
                ("rope.freq_base", "rope_base"), ("attention.layer_norm_rms_epsilon", "norm_eps"))


@dataclass(frozen=True)
class MTPHeadConfig:
    """Where a model's MTP block is and what its FFN is; the rest is the model's."""
    layer: int          # block index L = the main model's n_layers
    moe: bool           # routed experts (the model's) instead of a dense FFN
    d_ff: int           # dense FFN width (0 with moe)
    path: str           # the file holding the block's tensors
    sidecar: bool       # a separate GGUF (else the model file itself)

    @property
    def prefix(self) -> str:
        return f"blk.{self.layer}."


def mtp_tensors(cfg: ModelConfig, layer: int, moe: bool, d_ff: int) -> dict[str, tuple[int, ...]]:
    """The MTP block's tensors, name -> torch-order shape."""
    D, p = cfg.d_model, f"blk.{layer}."
    own = {p + MTP_OWN[0]: (D,), p + MTP_OWN[1]: (D,), p + MTP_OWN[2]: (D, 2 * D), p + MTP_OWN[3]: (D,)}
    return own | layer_tensors(cfg, layer, moe, d_ff)


def sidecar_path(model_path: str) -> str:
    """`<model stem>.mtp.gguf` next to the model."""
    stem = model_path[:-5] if model_path.lower().endswith(".gguf") else model_path
    return stem + SIDECAR_SUFFIX


def _check_sidecar(head: GGUFFile, cfg: ModelConfig) -> None:
    md, path = head.metadata, head.path
    arch = md.get("general.architecture")
    if arch != cfg.arch:
        raise GGUFError(f"{path}: MTP head is for architecture {arch!r}, the model is {cfg.arch!r}")
    n_next = _int(md, f"{arch}.nextn_predict_layers", path, 0, lo=0)
    blocks = _int(md, f"{arch}.block_count", path)
    if n_next < 1 or blocks != cfg.n_layers + n_next:
        raise GGUFError(f"{path}: not an MTP head for this model: nextn_predict_layers = {n_next} and "
                        f"block_count = {blocks}, expected >= 1 and {cfg.n_layers} + nextn_predict_layers")
    for key, field_ in _SHARED_KEYS:
        have = md.get(f"{arch}.{key}")
        want = getattr(cfg, field_)
        if have is not None and (type(have) not in (int, float)
                                 or not abs(have - float(want)) <= 1e-6 * max(1.0, abs(float(want)))):
            raise GGUFError(f"{path}: MTP head does not match the model: {arch}.{key} is {have}, "
                            f"the model has {want}")


def mtp_head_config(head: GGUFFile, cfg: ModelConfig, sidecar: bool) -> MTPHeadConfig:
    """Check the MTP block in `head` against the model and describe it; GGUFError if wrong."""
    if sidecar:
        _check_sidecar(head, cfg)
    L, t = cfg.n_layers, head.tensors
    p = f"blk.{L}."
    moe = p + "ffn_gate_inp.weight" in t
    if moe and not cfg.is_moe:
        raise GGUFError(f"{head.path}: the MTP block has routed experts but the model has none")
    gate = t.get(p + "ffn_gate.weight")
    d_ff = 0 if moe else (int(gate.shape[0]) if gate is not None else 0)
    check_shapes(mtp_tensors(cfg, L, moe, d_ff), t, f"{head.path}: MTP head")
    return MTPHeadConfig(L, moe, d_ff, head.path, sidecar)


def find_mtp_head(f: GGUFFile, cfg: ModelConfig,
                  draft_head: str | None = None) -> tuple[GGUFFile, MTPHeadConfig] | None:
    """The model's MTP head: `draft_head` if given, else the block inside the model file
    (nextn_predict_layers > 0), else `<stem>.mtp.gguf` next to the model; None if none."""
    if draft_head is not None:
        if not os.path.isfile(draft_head):
            raise GGUFError(f"{draft_head}: --draft-head file not found")
        head = GGUFFile(draft_head)
        return head, mtp_head_config(head, cfg, sidecar=True)
    if cfg.n_nextn > 0:
        return f, mtp_head_config(f, cfg, sidecar=False)
    side = sidecar_path(f.path)
    if os.path.isfile(side):
        head = GGUFFile(side)
        return head, mtp_head_config(head, cfg, sidecar=True)
    return None


from .arch_qwen35 import HYBRID_ARCHS  # noqa: E402  (the hybrids' module builds on the names above)

ARCHS |= {a.name: a for a in HYBRID_ARCHS}

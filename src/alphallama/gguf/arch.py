"""Architecture table: GGUF metadata -> ModelConfig, and the tensors each architecture
must provide (llama.cpp names, torch-order shapes).

Adding an architecture is one `ArchSpec` entry in `ARCHS`; the model code reads only
the flags of `ModelConfig`, never the architecture name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


ARCHS: dict[str, ArchSpec] = {a.name: a for a in (
    ArchSpec("llama", rope_neox=False),
    ArchSpec("qwen2", rope_neox=True, qkv_bias=True),
    ArchSpec("qwen3", rope_neox=True, qk_norm=True),
    ArchSpec("qwen3moe", rope_neox=True, qk_norm=True, moe=True),
)}


def _get(md: dict[str, Any], key: str, path: str, default: Any = None, required: bool = True):
    if key in md:
        return md[key]
    if required and default is None:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return default


def config_from_metadata(md: dict[str, Any], tensors: dict[str, Any] | None = None,
                         path: str = "<gguf>") -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(sorted(ARCHS))})")
    spec = ARCHS[arch]
    g = lambda k, d=None: _get(md, f"{arch}.{k}", path, d)  # noqa: E731
    d_model = int(g("embedding_length"))
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    vocab = md.get("tokenizer.ggml.tokens")
    if tensors is not None and "token_embd.weight" in tensors:
        n_vocab = tensors["token_embd.weight"].shape[0]
    elif isinstance(vocab, list):
        n_vocab = len(vocab)
    else:
        n_vocab = int(g("vocab_size"))
    cfg = ModelConfig(
        arch=arch,
        n_layers=int(g("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=int(g("feed_forward_length", 0)),
        vocab_size=int(n_vocab),
        ctx_len=int(g("context_length", 2048)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(g("rope.freq_base", 10000.0)),
        rope_dim=int(g("rope.dimension_count", head_dim)),
        rope_neox=spec.rope_neox,
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        n_experts=int(g("expert_count", 0)) if spec.moe else 0,
        n_experts_used=int(g("expert_used_count", 0)) if spec.moe else 0,
        d_ff_expert=int(g("expert_feed_forward_length", 0)) if spec.moe else 0,
        norm_topk_prob=bool(g("expert_weights_norm", True)),
        tied_embeddings=tensors is not None and "output.weight" not in tensors,
    )
    if spec.moe and not (cfg.n_experts > 0 and 0 < cfg.n_experts_used <= cfg.n_experts
                         and cfg.d_ff_expert > 0):
        raise GGUFError(f"{path}: {arch} needs expert_count, expert_used_count (1..expert_count) "
                        f"and expert_feed_forward_length in its metadata")
    if n_heads % n_kv or cfg.rope_dim > head_dim or cfg.rope_dim % 2:
        raise GGUFError(f"{path}: inconsistent attention shape: {n_heads} heads, {n_kv} kv heads, "
                        f"head_dim {head_dim}, rope dims {cfg.rope_dim}")
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, name -> torch-order shape ([out, in] for matrices)."""
    D, Q, KV, H = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.vocab_size, D),
        "output_norm.weight": (D,),
    }
    if not cfg.tied_embeddings:
        out["output.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        out |= {
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
        if cfg.is_moe:
            E, F = cfg.n_experts, cfg.d_ff_expert
            out |= {
                p + "ffn_gate_inp.weight": (E, D),
                p + "ffn_gate_exps.weight": (E, F, D),
                p + "ffn_up_exps.weight": (E, F, D),
                p + "ffn_down_exps.weight": (E, D, F),
            }
        else:
            F = cfg.d_ff
            out |= {p + "ffn_gate.weight": (F, D), p + "ffn_up.weight": (F, D),
                    p + "ffn_down.weight": (D, F)}
    return out


def load_config(f: GGUFFile) -> ModelConfig:
    """Config of a model file, after checking every expected tensor is there with its shape."""
    cfg = config_from_metadata(f.metadata, f.tensors, f.path)
    problems = []
    for name, shape in expected_tensors(cfg).items():
        t = f.tensors.get(name)
        if t is None:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
        elif tuple(t.shape) != shape:
            problems.append(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise GGUFError(f"{f.path}: {cfg.arch} model is malformed: " + "; ".join(problems[:3]) + more)
    return cfg

"""The MTP head for training: one DeepSeek-V3 / Qwen3-Next style multi-token-prediction
block in torch, trained for depths 1..K with exactly the attention mask of docs/MTP.md,
and the writer of its sidecar GGUF.

Stable interface (train/distill_mtp.py and the embedded-model trainer import these):

    MTPConfig(d_model, n_heads, n_kv_heads, head_dim, d_ff, norm_eps=1e-6, rope_base=1e6,
              rope_dim=0, rope_neox=True, qkv_bias=False, qk_norm=False)
    MTPConfig.from_model(cfg: ModelConfig, d_ff: int) -> MTPConfig   # flags from a main model

    head = MTPHead(cfg)                                  # an nn.Module, float32 parameters
    states = head(hidden, tokens, embed, depths=3)       # list of `depths` tensors [B, T, D]
        hidden: [B, T, D] the main model's last hidden state, BEFORE its final norm (h_p)
        tokens: [B, T] int64 token ids x_p;  embed: [V, D] the main model's token embedding
        states[k-1][:, p] = shared_head_norm(h') of the depth-k entry at position p, which
        predicts tokens[:, p + 1]; logits = states[k-1] @ output.T (the main model's head).
    losses = mtp_losses(states, output, tokens)          # list of scalar CE per depth
    losses = mtp_losses(states, output, tokens, chunk=8192, frac=0.25, generator=g)
                                                         # chunked CE over a random quarter
    mask = mtp_mask(T, k)                                # [T, k*T] bool, True = may attend

    write_sidecar(path, head, arch=..., n_layers=..., ctx_len=..., metadata={...},
                  qtype=GGMLQuantizationType.Q8_0)      # <stem>.mtp.gguf per docs/MTP.md
    head.gguf_tensors(n_layers) -> {gguf name: float32 tensor}   # what the sidecar holds

Semantics (docs/MTP.md): the depth-1 entry at position p is made from g = h_{p-1} and
x_p; the depth-k entry at p from g = h' of the depth-(k-1) entry at p-1 and x_p (teacher
forcing stands in for the drafted token). At p = 0 there is no earlier hidden state and
g is zeros (hnorm(0) = 0): the engine must make the position-0 entry the same way.
A depth-k query at p attends to depth-1 entries at j <= p-k+1 and to the
depth-(k-(p-j)) entry at each j in p-k+2..p, i.e. key (d, j) iff j <= p and
d == max(1, k-(p-j)). The loss of depth k counts positions p >= k (whose chain reaches
a real main-model hidden state, h_{p-k}) up to T-2 (a next token exists).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..gguf.arch import ModelConfig
from ..model.layers import apply_rope, rope_tables
from .ce import linear_ce, subset_rows


@dataclass(frozen=True)
class MTPConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int                  # width of the block's dense SwiGLU FFN
    norm_eps: float = 1e-6
    rope_base: float = 1e6
    rope_dim: int = 0          # rotated dims per head; 0 = head_dim
    rope_neox: bool = True     # Qwen layout (rotate halves); False: llama's adjacent pairs
    qkv_bias: bool = False     # qwen2
    qk_norm: bool = False      # qwen3 / qwen3moe

    @property
    def rot_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @classmethod
    def from_model(cls, cfg: ModelConfig, d_ff: int) -> "MTPConfig":
        return cls(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                   head_dim=cfg.head_dim, d_ff=d_ff, norm_eps=cfg.norm_eps, rope_base=cfg.rope_base,
                   rope_dim=cfg.rope_dim, rope_neox=cfg.rope_neox, qkv_bias=cfg.qkv_bias,
                   qk_norm=cfg.qk_norm)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 whatever the autocast dtype, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def mtp_mask(T: int, k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[T, k*T] bool: may the depth-k query at position p attend to key (d, j), stored at
    column (d-1)*T + j? Yes iff j <= p and d == max(1, k - (p - j)) (docs/MTP.md)."""
    p = torch.arange(T, device=device)[:, None]                 # [T, 1]
    j = torch.arange(T, device=device)[None, :]                 # [1, T]
    want = torch.clamp(k - (p - j), min=1)                      # [T, T] the depth seen at j
    return torch.cat([(j <= p) & (want == d) for d in range(1, k + 1)], dim=1)   # [T, k*T]


def shift_right(x: torch.Tensor) -> torch.Tensor:
    """g for position p is x at p-1; zeros at p = 0. x: [B, T, D]."""
    return F.pad(x[:, :-1], (0, 0, 1, 0))


class MTPHead(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.cfg = c = cfg
        D, Q, KV = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        ones = lambda n: nn.Parameter(torch.ones(n))  # noqa: E731
        self.enorm, self.hnorm, self.shared_head_norm = ones(D), ones(D), ones(D)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.attn_norm, self.ffn_norm = ones(D), ones(D)
        self.wq = nn.Linear(D, Q, bias=c.qkv_bias)
        self.wk = nn.Linear(D, KV, bias=c.qkv_bias)
        self.wv = nn.Linear(D, KV, bias=c.qkv_bias)
        self.wo = nn.Linear(Q, D, bias=False)
        if c.qk_norm:
            self.q_norm, self.k_norm = ones(c.head_dim), ones(c.head_dim)
        self.gate = nn.Linear(D, c.d_ff, bias=False)
        self.up = nn.Linear(D, c.d_ff, bias=False)
        self.down = nn.Linear(c.d_ff, D, bias=False)
        for lin in (self.eh_proj, self.wq, self.wk, self.wv, self.wo, self.gate, self.up, self.down):
            nn.init.normal_(lin.weight, std=1 / math.sqrt(lin.in_features))
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        # the residual branches start small so the block begins close to its input
        for lin in (self.wo, self.down):
            lin.weight.data.mul_(0.5)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = self.cfg
        B, T, _ = x.shape
        h = rms(x, self.attn_norm, c.norm_eps)
        q = self.wq(h).view(B, T, c.n_heads, c.head_dim)                         # [B, T, H, hd]
        k = self.wk(h).view(B, T, c.n_kv_heads, c.head_dim)                      # [B, T, n_kv, hd]
        v = self.wv(h).view(B, T, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = rms(q, self.q_norm, c.norm_eps), rms(k, self.k_norm, c.norm_eps)
        q = apply_rope(q, cos, sin, c.rope_neox).to(v.dtype)                      # [B, T, H, hd]
        k = apply_rope(k, cos, sin, c.rope_neox).to(v.dtype)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)           # [B, heads, T, hd]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, embed: torch.Tensor,
                depths: int = 3) -> list[torch.Tensor]:
        c = self.cfg
        B, T, D = hidden.shape
        cos, sin = (t.to(hidden.device) for t in rope_tables(T, c.rot_dim, c.rope_base))  # [T, rot/2]
        e = rms(F.embedding(tokens, embed), self.enorm, c.norm_eps)            # [B, T, D]
        g = shift_right(hidden)                                                # [B, T, D]
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        out = []
        group = c.n_heads // c.n_kv_heads
        for k in range(1, depths + 1):
            z = self.eh_proj(torch.cat([e, rms(g, self.hnorm, c.norm_eps)], dim=-1))  # [B, T, D]
            q, kk, vv = self._qkv(z, cos, sin)
            keys.append(kk)
            vals.append(vv)
            K = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)         # [B, H, k*T, hd]
            V = torch.cat(vals, dim=2).repeat_interleave(group, dim=1)
            if k == 1:   # the mask is plain causal: let SDPA pick its fastest kernel
                a = F.scaled_dot_product_attention(q, K, V, is_causal=True)   # [B, H, T, hd]
            else:
                a = F.scaled_dot_product_attention(q, K, V, attn_mask=mtp_mask(T, k, hidden.device))
            x = z + self.wo(a.transpose(1, 2).reshape(B, T, -1))               # [B, T, D]
            h = rms(x, self.ffn_norm, c.norm_eps)
            x = x + self.down(F.silu(self.gate(h)) * self.up(h))               # [B, T, D]
            out.append(rms(x, self.shared_head_norm, c.norm_eps))
            g = shift_right(x)                                                 # h' fed to depth k+1
        return out

    def gguf_tensors(self, n_layers: int) -> dict[str, torch.Tensor]:
        """The sidecar's tensors (llama.cpp names, torch-order shapes), float32 on CPU."""
        return {k: v.detach().float().cpu() for k, v in self.gguf_params(n_layers).items()}

    def gguf_params(self, n_layers: int) -> dict[str, torch.Tensor]:
        """{the sidecar's llama.cpp name: the parameter itself}."""
        p = f"blk.{n_layers}."
        named = {
            "nextn.enorm.weight": self.enorm, "nextn.hnorm.weight": self.hnorm,
            "nextn.eh_proj.weight": self.eh_proj.weight,
            "nextn.shared_head_norm.weight": self.shared_head_norm,
            "attn_norm.weight": self.attn_norm, "attn_q.weight": self.wq.weight,
            "attn_k.weight": self.wk.weight, "attn_v.weight": self.wv.weight,
            "attn_output.weight": self.wo.weight, "ffn_norm.weight": self.ffn_norm,
            "ffn_gate.weight": self.gate.weight, "ffn_up.weight": self.up.weight,
            "ffn_down.weight": self.down.weight,
        }
        if self.cfg.qkv_bias:
            named |= {"attn_q.bias": self.wq.bias, "attn_k.bias": self.wk.bias, "attn_v.bias": self.wv.bias}
        if self.cfg.qk_norm:
            named |= {"attn_q_norm.weight": self.q_norm, "attn_k_norm.weight": self.k_norm}
        return {p + k: v for k, v in named.items()}


def mtp_losses(states: list[torch.Tensor], output: torch.Tensor, tokens: torch.Tensor, *, chunk: int = 0,
               frac: float = 1.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Mean cross-entropy per depth over the positions p in [k, T-2] (see the module doc).
    states: list of [B, T, D]; output: [V, D]; tokens: [B, T]. chunk > 0: ce.linear_ce's
    chunked form (no [B, T, V] float32 logits); frac < 1: each depth's mean over a uniform
    random subset of frac of its positions (drawn from `generator`), an unbiased estimate
    of the mean over all of them at a fraction of the logits."""
    T = tokens.shape[1]
    losses = []
    for k, s in enumerate(states, start=1):
        if T - 1 - k <= 0:
            raise ValueError(f"sequences of {T} tokens are too short for MTP depth {k}")
        h = s[:, k:T - 1].flatten(0, 1)                                       # [B*(T-1-k), D]
        tgt = tokens[:, k + 1:].flatten()                                     # [B*(T-1-k)]
        rows = subset_rows(h.shape[0], frac, generator, h.device)
        if rows is not None:
            h, tgt = h[rows], tgt[rows]
        losses.append(linear_ce(h, output, tgt, chunk))
    return losses


# --- the sidecar GGUF ---------------------------------------------------------------

def add_metadata(w, metadata: Mapping[str, Any]) -> None:
    """Free-form keys (provenance): str, bool, int (uint64 / int64), float (float64)."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            (w.add_uint64 if value >= 0 else w.add_int64)(key, value)
        elif isinstance(value, float):
            w.add_float64(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            raise TypeError(f"metadata {key!r}: {type(value).__name__} is not str/bool/int/float")


def add_gguf_tensor(w, name: str, t: torch.Tensor, qtype) -> None:
    """One tensor: 1-D ones (norms, biases) stay F32 as llama.cpp keeps them; matrices in
    `qtype` (F32, F16 or a block type such as Q8_0 whose block divides the row)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    a = t.detach().float().cpu().numpy()
    if a.ndim == 1 or qtype == QT.F32:
        w.add_tensor(name, a)
    elif qtype == QT.F16:
        w.add_tensor(name, a.astype("float16"))
    else:
        w.add_tensor(name, quants.quantize(a, qtype), raw_dtype=qtype)


def write_sidecar(path: str | Path, head: MTPHead, *, arch: str, n_layers: int, ctx_len: int,
                  metadata: Mapping[str, Any] | None = None, qtype=None) -> None:
    """Write `head` as an MTP sidecar GGUF (docs/MTP.md): block index n_layers, the block's
    hyperparameters under `arch`, `{arch}.nextn_predict_layers = 1`, plus `metadata`."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFWriter
    qtype = QT.Q8_0 if qtype is None else qtype
    c = head.cfg
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(partial), arch)
    w.add_type("model")
    w.add_name(f"{path.stem} (MTP head)")
    w.add_block_count(n_layers + 1)
    w.add_context_length(ctx_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.rot_dim)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_nextn_predict_layers(1)
    add_metadata(w, metadata or {})
    for name, t in head.gguf_tensors(n_layers).items():
        add_gguf_tensor(w, name, t, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.replace(path)

"""An independent float64 forward pass over a GGUF model, for tests.

Plain numpy, written from llama.cpp's graphs (src/models/{llama,qwen2,qwen3,qwen3moe}.cpp)
and not from alphallama.model: it shares no code with the engine beyond the file
reader, and dequantizes with the gguf package's numpy reference. Full causal
attention over the whole sequence, no KV cache. Slow; for tiny models and short
sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from alphallama.gguf.reader import GGUFFile


@dataclass(frozen=True)
class _Arch:
    neox: bool              # rope: NEOX halves (x[i], x[i + d/2]) vs adjacent pairs (x[2i], x[2i+1])
    qkv_bias: bool = False
    qk_norm: bool = False   # per-head RMSNorm of q and k before rope
    moe: bool = False


_ARCHS = {
    "llama": _Arch(neox=False),
    "qwen2": _Arch(neox=True, qkv_bias=True),
    "qwen3": _Arch(neox=True, qk_norm=True),
    "qwen3moe": _Arch(neox=True, qk_norm=True, moe=True),
}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, n_rot: int, base: float, neox: bool) -> np.ndarray:
    """Rotate x [T, H, head_dim] at positions 0..T-1; dims past n_rot pass through.

    Pair i (0 <= i < n_rot/2) turns by pos * base^(-2i/n_rot); the pair is
    (x[i], x[i + n_rot/2]) in NEOX mode and (x[2i], x[2i+1]) otherwise."""
    T = x.shape[0]
    half = n_rot // 2
    theta = np.arange(T)[:, None] * base ** (-2.0 * np.arange(half) / n_rot)  # [T, half]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # [T, 1, half]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]  # [T, H, half] each
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]  # [T, H, half] each
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


class ReferenceModel:
    """`ReferenceModel(GGUFFile(path)).logits(tokens)` -> float64 [T, vocab]."""

    def __init__(self, f: GGUFFile, cache: bool = True):
        """cache=False dequantizes a weight at each use: a forward pass uses each weight
        once, and a 0.5B model held in float64 would take 4 GB."""
        self.f = f
        self.cache = cache
        md = f.metadata
        self.arch_name = md["general.architecture"]
        self.arch = _ARCHS[self.arch_name]
        key = lambda k, default=None: md.get(f"{self.arch_name}.{k}", default)  # noqa: E731
        self.n_layers = int(key("block_count"))
        self.d_model = int(key("embedding_length"))
        self.n_heads = int(key("attention.head_count"))
        self.n_kv = int(key("attention.head_count_kv", self.n_heads))
        self.head_dim = int(key("attention.key_length", self.d_model // self.n_heads))
        self.n_rot = int(key("rope.dimension_count", self.head_dim))
        self.rope_base = float(key("rope.freq_base", 10000.0))   # llama.cpp's default
        self.eps = float(key("attention.layer_norm_rms_epsilon"))
        self.n_expert_used = int(key("expert_used_count", 0))
        self._cache: dict[str, np.ndarray] = {}

    def weight(self, name: str) -> np.ndarray:
        """A tensor dequantized to float64 in torch order ([out, in] for matrices)."""
        if name in self._cache:
            return self._cache[name]
        t = self.f.tensors[name]
        raw = np.asarray(t.data).view(np.uint8)   # rows of stored bytes, whatever the type
        w = gguf_dequantize(raw, t.qtype).reshape(t.shape).astype(np.float64)
        if self.cache:
            self._cache[name] = w
        return w

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    # --- blocks -------------------------------------------------------------------

    def _attention(self, x: np.ndarray, p: str) -> np.ndarray:
        T, H, KV, hd = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        q = x @ self.weight(p + "attn_q.weight").T  # [T, H * hd]
        k = x @ self.weight(p + "attn_k.weight").T  # [T, KV * hd]
        v = x @ self.weight(p + "attn_v.weight").T  # [T, KV * hd]
        if self.arch.qkv_bias:
            q = q + self.weight(p + "attn_q.bias")
            k = k + self.weight(p + "attn_k.bias")
            v = v + self.weight(p + "attn_v.bias")
        q, k, v = q.reshape(T, H, hd), k.reshape(T, KV, hd), v.reshape(T, KV, hd)
        if self.arch.qk_norm:
            q = rms_norm(q, self.weight(p + "attn_q_norm.weight"), self.eps)
            k = rms_norm(k, self.weight(p + "attn_k_norm.weight"), self.eps)
        q = rope(q, self.n_rot, self.rope_base, self.arch.neox)  # [T, H, hd]
        k = rope(k, self.n_rot, self.rope_base, self.arch.neox)  # [T, KV, hd]
        group = H // KV
        k = np.repeat(k, group, axis=1)   # q head h reads kv head h // group: [T, H, hd]
        v = np.repeat(v, group, axis=1)   # [T, H, hd]
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)  # [H, T, T]
        future = np.triu(np.ones((T, T), dtype=bool), k=1)  # [T, T]
        scores = np.where(future, -np.inf, scores)
        out = np.einsum("hts,shd->thd", softmax(scores), v)  # [T, H, hd]
        return out.reshape(T, H * hd) @ self.weight(p + "attn_output.weight").T  # [T, D]

    @staticmethod
    def _swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        return (silu(x @ gate.T) * (x @ up.T)) @ down.T  # [T, D]

    def _ffn(self, x: np.ndarray, p: str) -> np.ndarray:
        return self._swiglu(x, self.weight(p + "ffn_gate.weight"), self.weight(p + "ffn_up.weight"),
                            self.weight(p + "ffn_down.weight"))

    def _moe(self, x: np.ndarray, p: str) -> np.ndarray:
        """Softmax over all experts, top-k, the k weights renormalised to sum to 1
        (llama.cpp's qwen3moe always renormalises), weighted sum of the k SwiGLUs."""
        gate, up, down = (self.weight(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        probs = softmax(x @ self.weight(p + "ffn_gate_inp.weight").T)  # [T, E]
        out = np.zeros_like(x)  # [T, D]
        for t in range(x.shape[0]):
            top = np.argsort(-probs[t], kind="stable")[:self.n_expert_used]  # [k]
            w = probs[t, top] / probs[t, top].sum()  # [k]
            for e, we in zip(top, w):
                out[t] += we * self._swiglu(x[t:t + 1], gate[e], up[e], down[e])[0]
        return out

    # --- the model ----------------------------------------------------------------

    def forward(self, tokens: Sequence[int]) -> tuple[np.ndarray, list[float]]:
        """(logits [T, vocab], RMS of the residual stream after each layer)."""
        emb = self.f.tensors["token_embd.weight"]
        rows = np.asarray(emb.data)[np.asarray(tokens)].view(np.uint8)   # only the rows used
        x = gguf_dequantize(rows, emb.qtype).reshape(len(tokens), -1).astype(np.float64)  # [T, D]
        layer_rms = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            x = x + self._attention(rms_norm(x, self.weight(p + "attn_norm.weight"), self.eps), p)
            h = rms_norm(x, self.weight(p + "ffn_norm.weight"), self.eps)
            x = x + (self._moe(h, p) if self.arch.moe else self._ffn(h, p))
            layer_rms.append(float(np.sqrt(np.mean(x * x))))
        x = rms_norm(x, self.weight("output_norm.weight"), self.eps)
        head = "output.weight" if self.has("output.weight") else "token_embd.weight"   # tied
        return x @ self.weight(head).T, layer_rms  # [T, vocab]

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        return self.forward(tokens)[0]

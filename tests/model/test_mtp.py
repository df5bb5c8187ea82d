"""The reference MTP block (model/mtp.py) against an independent float64 numpy version
written from docs/MTP.md: every entry's inputs as the doc defines them and every
query's keys chosen by the doc's rule, "a depth-k query at position p attends to the
depth-1 entries at positions <= p-k+1 and the depth-(k-(p-j)) entry at each j in
p-k+2..p", from a table of all entries (no KV cache). Weights are read with the gguf
package's numpy dequantizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from alphallama.gguf.arch import find_mtp_head, load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.model.mtp import MTPHead

CASES = {   # preset, FFN of the head, quant of the block's matrices
    "qwen3-dense": ("tiny-qwen3", "dense", None),
    "qwen2-bias-q8": ("tiny-qwen2", "dense", "Q8_0"),
    "llama-pairs": ("tiny-llama", "dense", None),
    "qwen3moe-moe-head": ("tiny-qwen3moe", "moe", None),
}


class NumpyMTP:
    """docs/MTP.md in float64, literally."""

    def __init__(self, f: GGUFFile):
        md = f.metadata
        a = md["general.architecture"]
        self.f, self.L = f, md[f"{a}.block_count"] - 1
        self.D = md[f"{a}.embedding_length"]
        self.H = md[f"{a}.attention.head_count"]
        self.KV = md[f"{a}.attention.head_count_kv"]
        self.hd = md.get(f"{a}.attention.key_length", self.D // self.H)
        self.base = md.get(f"{a}.rope.freq_base", 10000.0)
        self.eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
        self.neox, self.bias, self.qk_norm = a != "llama", a == "qwen2", a.startswith("qwen3")
        self.k_used = md.get(f"{a}.expert_used_count", 0)
        self.entries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}   # (depth, pos) -> k, v

    def w(self, name: str) -> np.ndarray:
        t = self.f.tensors[name]
        return gguf_dequantize(np.asarray(t.data).view(np.uint8), t.qtype).reshape(t.shape).astype(np.float64)

    def b(self, name: str) -> np.ndarray:
        return self.w(f"blk.{self.L}.{name}")

    def norm(self, x, w):
        return x / np.sqrt(np.mean(x * x) + self.eps) * w

    def rope(self, x, pos):   # x [heads, hd]
        half = self.hd // 2
        ang = pos * self.base ** (-2.0 * np.arange(half) / self.hd)
        c, s = np.cos(ang), np.sin(ang)
        out = x.copy()
        if self.neox:
            a, b = x[:, :half], x[:, half:]
            out[:, :half], out[:, half:] = a * c - b * s, a * s + b * c
        else:
            a, b = x[:, 0::2], x[:, 1::2]
            out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
        return out

    def swiglu(self, h, g, u, d):
        a = h @ g.T
        return (a / (1 + np.exp(-a)) * (h @ u.T)) @ d.T

    def entry(self, depth: int, pos: int, g: np.ndarray, token: int) -> np.ndarray:
        """Make the depth-`depth` entry at `pos` (replacing one made before); its h'."""
        emb = self.w("token_embd.weight")[token]
        z = self.b("nextn.eh_proj.weight") @ np.concatenate(
            [self.norm(emb, self.b("nextn.enorm.weight")), self.norm(g, self.b("nextn.hnorm.weight"))])
        h = self.norm(z, self.b("attn_norm.weight"))
        q, k, v = (self.b(f"attn_{n}.weight") @ h for n in "qkv")
        if self.bias:
            q, k, v = q + self.b("attn_q.bias"), k + self.b("attn_k.bias"), v + self.b("attn_v.bias")
        q, k, v = q.reshape(self.H, self.hd), k.reshape(self.KV, self.hd), v.reshape(self.KV, self.hd)
        if self.qk_norm:
            q = np.stack([self.norm(r, self.b("attn_q_norm.weight")) for r in q])
            k = np.stack([self.norm(r, self.b("attn_k_norm.weight")) for r in k])
        q, k = self.rope(q, pos), self.rope(k, pos)
        self.entries[(depth, pos)] = (k, v)
        # the doc's rule: depth-1 entries at j <= pos-depth+1, the depth-(depth-(pos-j)) one after
        keys = [(1, j) for j in range(pos - depth + 2)] + [(depth - (pos - j), j) for j in range(pos - depth + 2, pos + 1)]
        K = np.stack([self.entries[e][0] for e in keys], 1)          # [KV, n, hd]
        V = np.stack([self.entries[e][1] for e in keys], 1)
        grp = self.H // self.KV
        out = []
        for hh in range(self.H):
            s = K[hh // grp] @ q[hh] / np.sqrt(self.hd)
            p = np.exp(s - s.max())
            out.append((p / p.sum()) @ V[hh // grp])
        x = z + self.b("attn_output.weight") @ np.concatenate(out)
        h = self.norm(x, self.b("ffn_norm.weight"))
        if f"blk.{self.L}.ffn_gate_inp.weight" in self.f.tensors:
            r = self.b("ffn_gate_inp.weight") @ h
            pr = np.exp(r - r.max())
            pr /= pr.sum()
            top = np.argsort(-pr, kind="stable")[:self.k_used]
            ffn = sum(pr[e] / pr[top].sum() * self.swiglu(h[None], self.b("ffn_gate_exps.weight")[e],
                      self.b("ffn_up_exps.weight")[e], self.b("ffn_down_exps.weight")[e])[0] for e in top)
        else:
            ffn = self.swiglu(h[None], self.b("ffn_gate.weight"), self.b("ffn_up.weight"), self.b("ffn_down.weight"))[0]
        return x + ffn

    def logits(self, hp: np.ndarray) -> np.ndarray:
        head = "output.weight" if "output.weight" in self.f.tensors else "token_embd.weight"
        return self.w(head) @ self.norm(hp, self.b("nextn.shared_head_norm.weight"))

    def chain(self, hidden: np.ndarray, tokens: list[int], n: int, depth: int):
        """Depth-1 entries at 0..n (g = h_{p-1}, zeros at 0), then drafts 1..depth from
        position n: (tokens, probabilities, logits per draft)."""
        for p in range(n + 1):
            hp = self.entry(1, p, hidden[p - 1] if p else np.zeros(self.D), tokens[p])
        out, probs, logits = [], [], []
        for k in range(1, depth + 1):
            if k > 1:
                hp = self.entry(k, n + k - 1, hp, out[-1])
            lg = self.logits(hp)
            pr = np.exp(lg - lg.max())
            pr /= pr.sum()
            out.append(int(pr.argmax()))
            probs.append(float(pr.max()))
            logits.append(lg)
        return out, probs, logits


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    preset, ffn, quant = CASES[request.param]
    path = tmp_path_factory.mktemp("mtp") / f"{request.param}.gguf"
    write_synthetic(PRESETS[preset](n_layers=1, seed=5, mtp=ffn, quant=quant), path)
    f = GGUFFile(path)
    cfg = load_config(f)
    model = load_model(f, 64)
    head_file, hc = find_mtp_head(f, cfg)
    return f, model, MTPHead.load(head_file, hc, model, 64)


def _hidden(model, tokens):
    _, h = model.forward(torch.tensor(tokens), 0, model.new_cache(64), logits=False)
    return h                                                    # [T, D] float32


def test_chain_matches_f64_doc_semantics(case):
    f, model, head = case
    tokens = [int(t) for t in torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))]
    hidden = _hidden(model, tokens)
    ref = NumpyMTP(f)
    n, depth = 9, 4
    want, want_p, want_logits = ref.chain(hidden.double().numpy(), tokens, n, depth)
    cache = head.new_cache()
    g = torch.cat([torch.zeros(1, model.cfg.d_model), hidden[:n]])          # [n+1, D]: g of entries 0..n
    # the permanent entries in uneven batches, then the chain from the last one
    head.extend(g[:4], torch.tensor(tokens[:4]), 0, cache)
    head.extend(g[4:5], torch.tensor(tokens[4:5]), 4, cache)
    got, got_p = head.draft(g[5:], torch.tensor(tokens[5:n + 1]), 5, depth, cache)
    assert got == want
    np.testing.assert_allclose(got_p, want_p, rtol=1e-4)
    assert cache.length == n + 1                                  # chain entries are not committed
    # logits of each draft: recompute the chain step by step through block()
    hp = head.block(g[n:n + 1], torch.tensor(tokens[n:n + 1]), n, cache)
    for k in range(depth):
        if k:
            hp = head.block(hp, torch.tensor([got[k - 1]]), n + k, cache)
        lg = head.logits(hp)[0].double().numpy()
        np.testing.assert_allclose(lg, want_logits[k], atol=2e-4 * np.abs(want_logits[k]).max())


def test_chain_entries_are_overwritten_by_the_next_commit(case):
    """After a chain, committing more positions replaces its temporary entries: the
    next chain equals a fresh f64 computation over the committed tokens."""
    f, model, head = case
    tokens = [int(t) for t in torch.randint(0, model.cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(2))]
    hidden = _hidden(model, tokens)
    g = torch.cat([torch.zeros(1, model.cfg.d_model), hidden])                # g of entry p = row p
    cache = head.new_cache()
    head.draft(g[:6], torch.tensor(tokens[:6]), 0, 3, cache)                  # chain at 6, 7 (temporary)
    got, got_p = head.draft(g[6:11], torch.tensor(tokens[6:11]), 6, 3, cache)  # overwrites them
    want, want_p, _ = NumpyMTP(f).chain(hidden.double().numpy(), tokens, 10, 3)
    assert got == want
    np.testing.assert_allclose(got_p, want_p, rtol=1e-4)


def test_vocab_subset_scores_only_its_rows(case):
    _, model, head = case
    V = model.cfg.vocab_size
    tokens = torch.arange(5) + 3
    g = torch.randn(5, model.cfg.d_model, generator=torch.Generator().manual_seed(3))
    full = head.logits(head.extend(g, tokens, 0, head.new_cache()))[-1]        # [V]
    ids = torch.arange(0, V, 3)                                                # every third row
    head.set_vocab(ids)
    try:
        toks, probs = head.draft(g, tokens, 0, 1, head.new_cache())
    finally:
        head.set_vocab(None)
    best = int(ids[full[ids].argmax()])
    assert toks == [best]
    assert probs[0] == pytest.approx(float(torch.softmax(full[ids], -1).max()), rel=1e-5)

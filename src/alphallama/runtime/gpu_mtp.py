"""The MTP head on the GPU: the same block as model/mtp.py (docs/MTP.md) on the GPU
runtime's kernels, its drafting chain captured in CUDA graphs.

A round's MTP work is one graph replay and one host sync:

    extend: the staged rows (hidden states of the tokens the verify pass committed,
            and those tokens) make their permanent depth-1 entries, one batched block
    chain:  from the last entry, draft 1 = argmax of its logits over the draft
            vocabulary; draft k = a depth-k entry at the next position, fed h' of the
            previous entry (the hybrids' head, runtime/hybrid_mtp.py: shared_head_norm(h'))
            and the token it drafted (read on the device, never the host)
    out:    [tokens..., probabilities...] in one float64 buffer -> .tolist()

Graphs are keyed by (width bucket of the extend, depth); depth 0 is extend-only (the
prompt's entries during prefill, and staged rows no draft asked for). Inputs are
static buffers (hidden rows, tokens, first position, index of the last real row) so
one graph serves every position. Padding rows of a bucket write K/V past the real
entries, where the chain (or the next extend) overwrites them before anything reads
them. The MTP cache is a one-layer KVCache with slot = position (fp16, like the
model's), with room past the context for a padded bucket and a chain, which is also
where graph capture writes its warm-up rows.

The head scores the rows of the draft vocabulary: a [S, K] copy of those output rows
in their GGUF format (index_select of the planes, in place, so the graphs keep their
pointers), and argmax/softmax over S.

Parallel streams (`-np N`, `new_caches`): one cache of N slots (KVCache.split: slot s at
base s x R, R = a slot's entries and its chain's rows), the position input the row table
of kernels/attention/rows.py (each row's position and its slot's KV base; the chain's
steps get theirs on the device), so one set of graphs serves every slot, as the model's
rounds do (runtime/gpu_model.py). Each stream's chain is its own launch and host sync
(MTP's cost times the streams drafting in a round; spec/allot.py prices each stream's).
A bucket's padding rows then write at the spare rows past the slots. The table form
computes the scalar form's floats (tests/kernels/test_attention_rows.py), so a stream's
drafts do not depend on its slot or on the others; `-np 1` keeps the scalar form.
"""
from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl

from ..config import DEFAULTS
from ..gguf.arch import MTPHeadConfig
from ..gguf.reader import GGUFFile
from ..kernels.attention.decode import decode_attention
from ..kernels.attention.rows import BASE, POSITION, fill_table
from ..kernels.norm.rmsnorm import add_rmsnorm
from ..kernels.attention.rope import qkv_rope
from ..kernels.activations.silu import silu_mul
from ..kernels.gemv.qmatmul import qmatmul
from ..kernels.formats.qweight import QuantWeight
from ..model.layers import rope_tables
from .capture import collector_paused
from ..kernels.gemv.registry import ROWS_PER_THREAD
from .gpu_model import GPUModel
from .linear import Linear
from .widths import BUCKETS, MAX_W, bucket_of
from .weights import BlockNames, build_layer, vectors
from ..kv_cache import KVCache, KVSlot

SPARE = MAX_W + DEFAULTS.mtp.max_depth + 3     # slots past the context: a padded bucket and a chain


# -- picking a draft: argmax and its softmax probability in one kernel ----------------------
@triton.jit
def _pick_kernel(LOGITS, IDS, OUT, TOK, k, S: tl.constexpr, BLOCK: tl.constexpr, DEPTH: tl.constexpr):
    """One program over the S scores of one row: online max / argmax (first on ties) and
    sum of exp(x - max); writes the token id (IDS[argmax]) and 1 / sum, its probability,
    to OUT[k] and OUT[DEPTH + k] (float64), and the id to TOK[0] for the next step."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([], -float("inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    best = tl.full([], 0, tl.int32)
    for start in range(0, S, BLOCK):          # S is constexpr: a fixed trip count
        x = tl.load(LOGITS + start + offs, mask=start + offs < S, other=-float("inf"))
        cm = tl.max(x, 0)
        ci = tl.argmax(x, 0)
        new_m = tl.maximum(m, cm)
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
        best = tl.where(cm > m, start + ci, best)
        m = new_m
    tok = tl.load(IDS + best)
    tl.store(OUT + k, tok.to(tl.float64))
    tl.store(OUT + DEPTH + k, (1.0 / total).to(tl.float64))
    tl.store(TOK, tok)


def pick(logits: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, k: int) -> torch.Tensor:
    """logits [1, S] fp32, ids [S] int64 (scored row -> token id), out [2 * depth] float64:
    out[k] = the argmax's token id, out[depth + k] = its probability; -> the id [1] int64."""
    S, depth = logits.shape[1], out.shape[0] // 2
    tok = torch.empty(1, dtype=torch.int64, device=logits.device)
    _pick_kernel[(1,)](logits, ids, out, tok, k, S=S, BLOCK=min(4096, triton.next_power_of_2(S)), DEPTH=depth)
    return tok


def pick_ref(logits: torch.Tensor, ids: torch.Tensor) -> tuple[int, float]:
    """Plain-torch reference of `pick` for one row: (token id, probability)."""
    p = torch.softmax(logits[0].double(), -1)
    i = int(p.argmax())
    return int(ids[i]), float(p[i])


class GPUMTPHead:
    """Same interface as model.mtp.MTPHead: new_cache, set_vocab, extend, draft (+ prepare)."""

    def __init__(self, model: GPUModel, head_file: GGUFFile, hc: MTPHeadConfig, max_len: int,
                 graphs: bool | None = None):
        self.model, self.cfg, self.hc = model, model.cfg, hc
        dev = self.device = model.device
        t, p = head_file.tensors, hc.prefix
        vec = vectors(t, dev)
        self.enorm, self.hnorm = vec(p + "nextn.enorm.weight"), vec(p + "nextn.hnorm.weight")
        self.head_norm = vec(p + "nextn.shared_head_norm.weight")
        self.eh = Linear([t[p + "nextn.eh_proj.weight"]], dev)
        self.act_dtype = model.act_dtype
        self.layer = self._load_block(t, hc)
        self.max_len = max_len
        cos, sin = self._rope_tables(max_len + SPARE)
        self.cos, self.sin = cos.to(dev), sin.to(dev)                             # [max_len+SPARE, rope/2]
        self.full = model.output.weights[0]                                       # [V, D] the model's head
        self.scored = self.full
        self.vocab_ids: torch.Tensor | None = None                                # [S] on the host; None: all
        self._ids = torch.arange(self.full.N, device=dev)                         # scored row -> token id
        D = self.cfg.d_model
        self._g = torch.zeros(MAX_W, D, device=dev)                               # graph inputs
        self._tok = torch.zeros(MAX_W, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(1, dtype=torch.int32, device=dev)    # or the row table [3, MAX_W] (new_caches)
        self._last = torch.zeros(1, dtype=torch.int64, device=dev)
        self._steps = torch.arange(DEFAULTS.mtp.max_depth, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self._pool = None
        self.cache: KVCache | None = None
        self.use_graphs = dev.type == "cuda" if graphs is None else graphs
        self.capture_s = 0.0

    # -- what a head of another block kind overrides (runtime/hybrid_mtp.py) ----------------
    def _load_block(self, t: dict, hc: MTPHeadConfig):
        """The head's block on fp32 GEMVs (qmatmul, the control arm), not the model's plan: on
        int8 activations tests/runtime/test_gpu_mtp's MoE chain flips a near tie against the
        reference (no split runs, no tensor cores: the block calls each Linear whole)."""
        return build_layer(t, BlockNames(hc.prefix), self.cfg, self.device, hc.moe, "f32", "f32")

    def _rope_tables(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(n, self.cfg.rope_dim, self.cfg.rope_base)

    def _entry(self, g: torch.Tensor) -> torch.Tensor:
        """What a depth-1 entry's g [W, D] (the main model's hidden rows) enters the block as."""
        return g

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """Entries for positions 0..max_len (the token after a full context has one too)."""
        c = self.cfg
        n = max_len or self.max_len
        cache = KVCache(1, c.n_kv_heads, n + SPARE, c.head_dim, dtype=torch.float16, device=self.device)
        cache.max_len = n + 1
        self.cache = cache
        self._pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.graphs.clear()
        return cache

    def new_caches(self, max_len: int | None = None, n: int = 1) -> list[KVCache]:
        """A cache for each of n engine slots: new_cache's for n == 1; else slots of one cache
        (the module docstring), each of entries 0..max_len and its chain's rows past them."""
        if n == 1:
            return [self.new_cache(max_len)]
        c = self.cfg
        entries = (max_len or self.max_len) + 1
        rows = entries + DEFAULTS.mtp.max_depth                 # a chain writes up to max_depth - 1 past the last
        whole = KVCache(1, c.n_kv_heads, n * rows + SPARE, c.head_dim, dtype=torch.float16, device=self.device)
        whole.max_len = n * rows                                # the rows past it: padding and the capture's
        self.cache = whole
        self._pos = torch.zeros(3, MAX_W, dtype=torch.int32, device=self.device)   # the row table
        self.graphs.clear()
        slots = whole.split(n, rows)
        for slot in slots:
            slot.max_len = entries
        return slots

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Score only these output rows (token ids [S]); None: all. Rows are copied into
        a buffer kept for the graphs; a new size re-captures them."""
        if ids is None or len(ids) == self.full.N:
            if self.scored is not self.full:
                self.scored, self.vocab_ids = self.full, None
                self._ids = torch.arange(self.full.N, device=self.device)
                self._drop_chain_graphs()
            return
        S = len(ids)
        dev_ids = ids.to(self.device, torch.int64)
        if self.scored is self.full or self.scored.N != S:
            planes = {n: torch.empty(S, pl.shape[1], dtype=pl.dtype, device=self.device)
                      for n, pl in self.full.planes.items()}
            self.scored = QuantWeight(self.full.qtype, (S, self.full.K), planes)
            self._ids = torch.empty(S, dtype=torch.int64, device=self.device)
            self._drop_chain_graphs()
        for n, pl in self.full.planes.items():
            torch.index_select(pl, 0, dev_ids, out=self.scored.planes[n])          # [S, per_row]
        self._ids.copy_(dev_ids)
        self.vocab_ids = ids.to(torch.int64).cpu()

    def _drop_chain_graphs(self) -> None:
        self.graphs = {k: v for k, v in self.graphs.items() if k[1] == 0}

    # -- the block and the chain (what the graphs hold) -----------------------------------
    def _block(self, g: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
               cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries at positions pos..pos+W-1 (pos: int32 [1] on the device) from g [W, D]
        fp32 and tokens [W]: -> (what the next depth's entry is fed: h' [W, D] fp32,
        shared_head_norm(h') [W, D] in act dtype)."""
        c, L = self.cfg, self.layer
        act = self.act_dtype
        x = self._project(g, tokens)                                                # [W, D] fp32
        h = add_rmsnorm(x, None, L.attn_norm, c.norm_eps, act)
        qkv = L.qkv(h)                                                              # [W, (H + 2 n_kv) hd]
        q = qkv_rope(qkv, L.qkv_bias, L.q_norm, L.k_norm, self.cos, self.sin, cache.k[0], cache.v[0], pos,
                     c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.rope_neox)       # [W, H, hd]
        att = decode_attention(q, cache.k[0], cache.v[0], pos, cache.k.shape[2], act,
                               tiles=self.model.attn_tiles)                        # [W, H*hd]
        h = add_rmsnorm(x, L.o(att), L.ffn_norm, c.norm_eps, act)                  # x += o(att)
        d = L.moe(h, act) if L.moe is not None else L.down(silu_mul(L.gate_up(h), act))   # [W, D]
        if L.shared is not None:
            d = d + L.shared(h, act)
        hn = add_rmsnorm(x, d, self.head_norm, c.norm_eps, act)                    # x += ffn: h'
        return x, hn

    def _project(self, g: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat([enorm(embed(tokens)), hnorm(g)])): g [W, D] fp32, tokens [W] -> [W, D] fp32."""
        c, act = self.cfg, self.act_dtype
        a = add_rmsnorm(self.model.embed(tokens), None, self.enorm, c.norm_eps, act)   # [W, D]
        b = add_rmsnorm(g, None, self.hnorm, c.norm_eps, act)                         # [W, D]
        return self.eh(torch.cat([a, b], dim=1))

    def _run(self, b: int, depth: int, cache: KVCache) -> torch.Tensor | None:
        """The static inputs' first b rows through the block; then (depth > 0) the chain
        -> [2 * depth] float64: drafted token ids, then their probabilities."""
        g, hn = self._block(self._entry(self._g[:b]), self._tok[:b], self._pos, cache)
        if depth == 0:
            return None
        out = torch.empty(2 * depth, dtype=torch.float64, device=self.device)
        g, hn = g.index_select(0, self._last), hn.index_select(0, self._last)    # [1, D] the last real row
        pos = self._chain_positions(depth)
        tok = None                                                                 # step k > 0 feeds step k-1's pick
        for k in range(depth):
            if k:
                g, hn = self._block(g, tok, pos[k], cache)
            logits = qmatmul(hn, self.scored, rows_per_thread=ROWS_PER_THREAD)     # [1, S]
            tok = pick(logits, self._ids, out, k)                                  # [1]
        return out

    def _chain_positions(self, depth: int) -> list[torch.Tensor]:
        """Each chain step's position input (device ops: in the graph): step k's entry is the
        last real row's position + k. int32 [1] each (one stream), or a row table [3, 1] each
        (its position, the slot's base, and as the first position of its one-row launch, its own)."""
        if self._pos.dim() == 1:
            pos = self._pos + self._last.to(torch.int32) + self._steps[:depth]     # [depth]
            return [pos[k:k + 1] for k in range(depth)]
        p = self._pos[POSITION].index_select(0, self._last) + self._steps[:depth]   # [depth]
        table = torch.stack([p, self._pos[BASE, :1].expand(depth), p], dim=1)      # [depth, 3] (rows.py's order)
        return [table[k].view(3, 1) for k in range(depth)]

    def _seat(self, m: int, pos: int, cache: KVCache) -> KVCache:
        """Set the position input for m rows at pos.. of `cache` (a slot of the head's cache, or
        a cache of its own; m = 0: every row padding) -> the cache the launch writes."""
        whole = _whole(cache)
        if self._pos.dim() == 1:
            self._pos.fill_(pos)
        else:
            base = cache.base if isinstance(cache, KVSlot) else 0
            fill_table(self._pos, [(m, pos, base)] if m else [], whole.max_len)
        return whole

    # -- graphs --------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare(self, depth: int, cache: KVCache) -> None:
        """Capture the extend-only and the depth-`depth` graphs of every bucket."""
        for b in BUCKETS:
            if not (self.use_graphs and _whole(cache) is self.cache):
                return
            self._graph(b, 0)
            self._graph(b, depth)

    def _graph(self, b: int, depth: int):
        """The graph of (bucket, depth), captured on first use. Should capture fail, the head
        runs eagerly from then on (slower, same results) rather than take the engine down."""
        key = (b, depth)
        if key not in self.graphs:
            try:
                self._capture(b, depth)
            except RuntimeError as e:
                print(f"alphallama: warning: MTP head graph capture failed ({e}); running it without "
                      f"CUDA graphs", file=sys.stderr)
                self.use_graphs = False
                return None
        return self.graphs[key]

    def _capture(self, b: int, depth: int) -> None:
        """Warm up at this width (compiling its kernels), then capture into the shared pool."""
        t0 = time.perf_counter()
        cache = self.cache
        self._seat(0, cache.max_len, cache)   # warm-up rows land in the spare slots
        self._last.fill_(0)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(b, depth, cache)        # compiles the kernels at this width
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(g, pool=self._pool):     # runtime/capture.py
            out = self._run(b, depth, cache)
        torch.cuda.synchronize()
        self.graphs[(b, depth)] = (g, out)
        self.capture_s += time.perf_counter() - t0

    def _launch(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, depth: int,
                cache: KVCache) -> torch.Tensor | None:
        """Up to MAX_W rows: load the static inputs, replay (or run) the graph."""
        m = tokens.shape[0]
        b = bucket_of(m)
        graph = self._graph(b, depth) if self.use_graphs and _whole(cache) is self.cache else None
        self._g[:m].copy_(g)
        self._tok[:m].copy_(tokens)
        whole = self._seat(m, pos, cache)
        self._last.fill_(m - 1)
        if graph is None:
            return self._run(m, depth, whole)
        graph[0].replay()
        return graph[1]

    # -- what the engine and the drafter call ----------------------------------------------
    @torch.inference_mode()
    def extend(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, cache: KVCache) -> None:
        """Permanent depth-1 entries at pos..pos+m-1 (cache.length becomes pos+m)."""
        m = tokens.shape[0]
        if pos > cache.length or pos + m > cache.max_len:
            raise ValueError(f"MTP entries {pos}..{pos + m} do not fit a cache of {cache.length}/{cache.max_len}")
        for s in range(0, m, MAX_W):
            self._launch(g[s:s + MAX_W], tokens[s:s + MAX_W], pos + s, 0, cache)
        cache.length = pos + m

    @torch.inference_mode()
    def draft(self, g: torch.Tensor, tokens: torch.Tensor, pos: int, depth: int,
              cache: KVCache) -> tuple[list[int], list[float]]:
        """extend, then a chain of `depth` drafts from the last entry, in one replay."""
        m = tokens.shape[0]
        head = max(0, m - MAX_W)                  # rows beyond one bucket: entries first
        if head:
            self.extend(g[:head], tokens[:head], pos, cache)
        if pos + m > cache.max_len:
            raise ValueError(f"MTP entries {pos}..{pos + m} do not fit a cache of {cache.length}/{cache.max_len}")
        out = self._launch(g[head:], tokens[head:], pos + head, depth, cache).tolist()   # the one host sync
        cache.length = pos + m
        return [int(v) for v in out[:depth]], out[depth:]


def _whole(cache: KVCache) -> KVCache:
    """The cache a slot is part of (a cache of its own: itself)."""
    return cache.parent if isinstance(cache, KVSlot) else cache

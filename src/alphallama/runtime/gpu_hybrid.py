"""The GPU model of a hybrid (qwen35, qwen35moe, qwen3next): Gated DeltaNet layers and gated
full-attention layers (runtime/hybrid_round.py), the same interface as GPUModel and the
reference HybridTransformer: new_cache, forward, verify.

- forward: up to 64 rows run as one round with the step kernel (the recurrent states
  written); more (a prompt) in chunks of prefill_chunk through the prefill path
  (deltanet_prefill, the scratch's GEMMs, SDPA). The engine sends a prompt's last row alone,
  so the logits that choose the first token come from the round's arithmetic.
- verify: W > 1 rows in one round of the verify kernel (every kernel row-invariant: exact and
  fast mode are the same pass); the cache keeps the round open, and the engine's truncate to
  the accepted prefix commits it (one deltanet_commit launch for every recurrent layer, n on
  the device; runtime/hybrid_cache.py).
- On the GPU the rounds replay CUDA graphs captured per cache (runtime/hybrid_graphs.py: the
  step, and the verify round per width bucket; a prompt's 2..64 rows are a verify round
  committed to all of them); elsewhere they run eagerly. The in-file MTP head runs beside it
  as runtime/hybrid_mtp.py's GPUHybridMTPHead (spec/mtp.py's load_mtp_states picks it).
- round (parallel streams, `-np N`: new_cache(slots=N), decisions/parallel-streams.md): several
  streams' rows side by side in passes of up to 64 rows over one HybridSlots cache, each stream
  on its own K/V rows, ring and state (runtime/hybrid_seats.py); a stream's one row is a step,
  its wider verify round stays open for its own commit. With slots every call runs this way,
  one stream's too; the graphs are captured once on the slots' storage, a bucket for any mix.
"""
from __future__ import annotations

import torch

from ..config import DEFAULTS
from ..gguf.arch import load_config
from ..gguf.arch_qwen35 import HybridConfig
from ..gguf.reader import GGUFFile
from ..kernels.attention.decode import Tiles
from ..kernels.deltanet.fla_rule import prefill_rule
from ..kernels.deltanet.step import deltanet_commit
from ..kernels.gemv.registry import DEFAULT_KERNELS, Kernels
from ..offload.estimate import MissRates
from ..model.qwen35 import hybrid_rope_tables
from . import hybrid_graphs, hybrid_round
from .gpu_model import GPUModel
from .hybrid_cache import GPUHybridCache, HybridSlot, HybridSlots
from .hybrid_layers import build_hybrid_layer, deltanet_shape, stacked_deltanet
from .hybrid_seats import Seats
from .overrides import PRODUCT, Overrides
from .scratch import activation_dtype, prefill_scratch
from .store_rounds import StoreRounds, expert_store
from .weights import load_head
from .widths import MAX_W


class GPUHybridModel(StoreRounds):
    """Same interface as the reference HybridTransformer: new_cache, forward, verify."""

    embed = GPUModel.embed          # tokens [T] -> [T, D] fp32: the same table and gather

    def __init__(self, f: GGUFFile, max_len: int, device: str | torch.device = "cuda", progress=None,
                 prefill_chunk: int | None = None, overrides: Overrides = PRODUCT, kernels: Kernels = DEFAULT_KERNELS,
                 graphs: bool | None = None, expert_slots: int | None = None, cpu_threads: int | None = None,
                 cpu_tier: bool | None = None, host_bytes: int | None = None, miss_rates: MissRates | None = None):
        """expert_slots, cpu_threads, cpu_tier, host_bytes, miss_rates: an MoE hybrid's routed
        experts in an expert store, as GPUModel's (runtime/store_rounds.py); None: resident."""
        cfg = load_config(f)
        if not isinstance(cfg, HybridConfig):
            raise TypeError(f"{f.path}: {cfg.arch} is not a Gated DeltaNet hybrid (runtime.gpu_model runs it)")
        if cfg.head_dim < 16 or cfg.head_dim & (cfg.head_dim - 1):
            raise NotImplementedError("the GPU runtime needs a power-of-two head_dim >= 16")
        self.cfg: HybridConfig = cfg
        self.overrides = o = overrides
        self.device = torch.device(device)
        self.max_len = max_len
        t = f.tensors
        self.store = expert_store(f, cfg, expert_slots, self.device, progress, host_bytes)
        self.layers = []
        for i in range(cfg.n_layers):
            self.layers.append(build_hybrid_layer(t, i, cfg, self.device, o.decode_gemv, o.moe_gemv, kernels,
                                                  store=self.store))
            if progress is not None:
                progress(f"layer {i}", 0)
        self._start_workers([L.moe for L in self.layers if L.moe is not None], cfg.d_model, cfg.n_experts_used,
                            cpu_tier, cpu_threads, host_bytes, miss_rates, progress)
        self.deltanet = stacked_deltanet(t, cfg, self.device)      # [Lr, C, d_conv], [Lr, Hv], [Lr, Hv]
        self.deltanet_shape = deltanet_shape(cfg)
        self.deltanet_shape.check()
        self.output_norm, self.output, self.embd, self.embd_qtype = load_head(t, self.device, o.decode_gemv,
                                                                              kernels=kernels)
        self.embed_scale = 1.0
        cos, sin = hybrid_rope_tables(max_len + MAX_W, cfg)                  # [max_len + 64, rope_dim / 2]
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.act_dtype = activation_dtype(self.device)
        self.attn_tiles = Tiles(*o.attention_tiles)
        self.prefill_path = o.prefill_path
        self.delta_rule_name, self.delta_rule = prefill_rule(o.deltanet_prefill, self.device)   # fla's or ours
        self.prefill_chunk = prefill_chunk or DEFAULTS.engine.prefill_chunk
        self.scratch = prefill_scratch(o, self.act_dtype, self.device, graphs=False)
        self._pos = torch.zeros(1, dtype=torch.int32, device=self.device)           # the round's position
        self._tokens = torch.zeros(MAX_W, dtype=torch.int64, device=self.device)    # the graphs' rows
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0
        self._commit_pos = torch.zeros(1, dtype=torch.int32, device=self.device)    # the commit's (pos, n)
        self._commit_n = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.cache: GPUHybridCache | HybridSlots | None = None
        self.seats: Seats | None = None   # a HybridSlots cache's pass inputs (parallel streams)
        self.hybrid = False          # (GPUModel's fast-mode flag: no tensor-core family here)

    def new_cache(self, max_len: int | None = None, slots: int = 1) -> GPUHybridCache | HybridSlots:
        """The model's cache (its graphs captured on it). slots > 1 (parallel streams): the
        storage of `slots` slots of max_len rows (its split gives the engine's slots)."""
        c = self.cfg
        rows = max_len or self.max_len
        if slots < 1 or (slots > 1 and rows > self.max_len):   # (a slot's positions: the rope tables')
            raise ValueError(f"a cache of {slots} slots of {rows} rows (this model's positions: {self.max_len})")
        shape = (len(c.attn_layers), c.n_kv_heads)
        rec = (len(c.recurrent_layers), c.conv_dim, (c.ssm_v_heads, c.ssm_head_dim, c.ssm_head_dim))
        if slots == 1:
            cache = GPUHybridCache(*shape, rows + MAX_W, c.head_dim, *rec, self._commit, self.device)
            cache.max_len -= MAX_W
            self.seats = None
        else:
            cache = HybridSlots(slots, rows, *shape, c.head_dim, *rec, self._commit, self.device)
            self.seats = Seats.new(slots, self.device)
        self.cache = cache
        self.graphs.clear()
        if self.use_graphs:
            self.capture_s = hybrid_graphs.capture(self, cache)
        return cache

    def _round(self, tokens: torch.Tensor, pos: int, cache: GPUHybridCache,
               verify: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """W <= 64 rows at pos: through the graphs when they were captured on this cache (a
        forward of W > 1 rows is a verify round committed to all W), else eagerly. A slot's:
        a pass of its rows alone (a forward's a step of W rows)."""
        if isinstance(cache, HybridSlot):
            return self._pass([(tokens, pos, cache, not verify)])
        self._pos.fill_(pos)
        W = tokens.shape[0]
        self._before_store_round(W)
        if not (self.use_graphs and cache is self.cache):
            out = hybrid_round.rows(self, tokens, self._pos, cache, verify)
        else:
            out = hybrid_graphs.replay(self, tokens, verify or W > 1)
            if W > 1 and not verify:
                self._commit(cache, pos, W)
        self._after_store_round(W, 1)
        return out

    def _commit(self, cache: GPUHybridCache, pos: int, n: int) -> None:
        """The state after the first n rows of the verify round at pos, every recurrent layer at once."""
        hv = self.cfg.ssm_v_heads
        self._commit_pos.fill_(pos)
        self._commit_n.fill_(n)
        deltanet_commit(cache.ab[:, :, hv:], cache.ab[:, :, :hv], self.deltanet, cache.ring, cache.ssm,
                        self._commit_pos, self._commit_n, self.deltanet_shape)

    def _check(self, tokens: torch.Tensor, pos: int, cache: GPUHybridCache) -> None:
        T = tokens.shape[0]
        if isinstance(cache, HybridSlot) and cache.parent is not self.cache:
            raise ValueError("a slot of another cache than this model's (its graphs and seats are the latest new_cache's)")
        if pos > cache.length or pos + T > cache.max_len:
            raise ValueError(f"rows {pos}..{pos + T} do not fit a cache of {cache.length}/{cache.max_len}")
        cache.prepare(pos)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos: int, cache: GPUHybridCache,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows at pos..pos+T-1 from the state at pos -> (logits [T, V] or None, hidden [T, D])."""
        self._check(tokens, pos, cache)
        tokens = tokens.to(self.device)
        T = tokens.shape[0]
        if T > MAX_W and self.prefill_path == "dequant":
            outs = [hybrid_round.prefill_rows(self, tokens[s:s + self.prefill_chunk], pos + s, cache, logits)
                    for s in range(0, T, self.prefill_chunk)]
        else:
            outs = []
            for s in range(0, T, MAX_W):
                lg, hd = self._round(tokens[s:s + MAX_W], pos + s, cache, verify=False)
                # the graphs' outputs are static buffers: the next chunk would overwrite them
                outs.append((lg.clone(), hd.clone()) if T > MAX_W else (lg, hd))
        cache.length = pos + T
        hidden = torch.cat([o[1] for o in outs]) if len(outs) > 1 else outs[0][1]
        if not logits:
            return None, hidden
        return (torch.cat([o[0] for o in outs]) if len(outs) > 1 else outs[0][0]), hidden

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, pos: int, cache: GPUHybridCache, exact: bool = True):
        """A round of W rows (W <= 64) that leaves the states for the cache's commit: the
        engine's truncate to the accepted prefix keeps exactly its rows (W = 1: a plain step)."""
        W = tokens.shape[0]
        if W == 1:
            return self.forward(tokens, pos, cache)
        if W > MAX_W:
            raise ValueError(f"a verify round takes at most {MAX_W} rows, got {W}")
        self._check(tokens, pos, cache)
        out = self._round(tokens.to(self.device), pos, cache, verify=True)
        cache.length = pos + W
        cache.open_round(pos, W)
        return out

    # -- parallel streams ------------------------------------------------------------------
    @torch.inference_mode()
    def round(self, parts: list[tuple[torch.Tensor, int, GPUHybridCache]], exact: bool = True):
        """Several streams' verify rows, parts [(tokens [w], first position, slot)], side by side
        in passes of up to 64 rows -> [(logits [w, V], hidden [w, D])] per part: the bits each
        part's verify gives alone (every kernel is row-invariant; each stream's recurrent rows
        walk its own state). A part of one row is a step; a wider one a verify round left open
        on its slot for its commit. Without slots (one cache), each part is its own verify.
        Outputs may be the graphs' static buffers, valid until the next call."""
        if self.seats is None:
            return [self.verify(t, p, c, exact) for t, p, c in parts]
        outs: list = [None] * len(parts)
        group: list[int] = []
        for i, (t, p, c) in enumerate(parts):
            if t.shape[0] > MAX_W:
                raise ValueError(f"a verify round takes at most {MAX_W} rows, got {t.shape[0]}")
            self._check(t, p, c)               # (an open round of the slot settled: its gates are its own)
            if sum(parts[j][0].shape[0] for j in group) + t.shape[0] > MAX_W:
                self._seated(parts, group, outs, clone=True)
                group = []
            group.append(i)
        if group:
            self._seated(parts, group, outs, clone=any(o is not None for o in outs))
        return outs

    def _seated(self, parts, group: list[int], outs: list, clone: bool) -> None:
        """parts[group] in one pass; outs[i] <- part i's (logits, hidden) (cloned: later passes follow)."""
        sel = [parts[i] for i in group]
        lg, hd = self._pass([(t.to(self.device), p, c, t.shape[0] == 1) for t, p, c in sel])
        r = 0
        for i, (t, p, c) in zip(group, sel):
            w = t.shape[0]
            outs[i] = (lg[r:r + w].clone(), hd[r:r + w].clone()) if clone else (lg[r:r + w], hd[r:r + w])
            c.length = p + w
            if w > 1:
                c.open_round(p, w)
            r += w

    def _pass(self, parts: list[tuple[torch.Tensor, int, HybridSlot, bool]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the slots' storage: parts [(tokens [w] on the device, first position,
        slot, write: a step, else a verify round)] -> (logits [W, V], hidden [W, D])."""
        self.seats.fill([(c, p, t.shape[0], write) for t, p, c, write in parts], self.cache.max_len)
        tokens = torch.cat([t for t, *_ in parts])                                     # [W]
        self._before_store_round(tokens.shape[0])   # with a store: one of its rounds, every stream's routing
        if self.use_graphs:          # a bucket's graph: steps and verify rounds differ in the seats
            out = hybrid_graphs.replay(self, tokens, verify=True)
        else:
            out = hybrid_round.rows(self, tokens, self.seats.table, self.cache, False, self.seats)
        self._after_store_round(tokens.shape[0], len(parts))
        return out

"""The GPU model: quantized weights in VRAM, Triton kernels, one CUDA graph per width.

Weights stay in their GGUF block formats (re-laid as `QuantWeight` planes, ~the file's
size); nothing is dequantized to bf16 ahead of time. A round of W rows is

    embed -> per layer: [add+RMSNorm] -> qkv qmatmul -> bias/qk-norm/RoPE/KV write
          -> split-KV attention -> o qmatmul -> [add+RMSNorm] -> gate|up qmatmul
          -> SiLU*up -> down qmatmul -> ... -> [add+RMSNorm] -> output qmatmul

(an MoE layer's FFN is: router qmatmul -> softmax/top-k -> gate|up+SiLU of its k
experts -> down + weighted sum, kernels/moe/moe_f32.py, the expert ids never leaving the device)

and every kernel gives a row the same bits whatever W and its column, so verify and
plain decode agree bit for bit: exact mode needs no per-row loop here.

Prefill. A call of more than 64 rows (a prompt chunk) takes the tensor-core path
(gpu_prefill.py: weights dequantized into a scratch buffer, cuBLAS GEMMs, SDPA) in
chunks of `prefill_chunk` rows, unless prefill_path is "gemv" (then: 64-row rounds
through the graphs). Its rows differ in the last bits from what decode rounds would
compute for the same tokens. Plain greedy and speculative decoding share the prefill,
so exact mode (spec == plain) still holds; what no longer holds is that KV rows made
by decode rounds and later re-used as a prompt prefix are the bits a fresh prefill
would compute (a conversation continued from the cache can differ in late bits from
the same text prefilled from scratch). Calls of up to 64 rows (the engine sends the
last prompt row alone) always go through the graphs.

On the GPU the round is one captured CUDA graph per width bucket (static token and
position buffers copied into before replay, captured once at load). Without CUDA
(tests under TRITON_INTERPRET=1) the same code runs eagerly.
"""
from __future__ import annotations

import torch

from ..config import DEFAULTS
from ..gguf.arch import ModelConfig, load_config
from ..gguf.quants import dequantize
from ..gguf.reader import GGUFFile
from ..kernels.activations.silu import GATED
from ..kernels.formats.dequant import gather_rows
from ..kernels.formats.qweight import QuantWeight
from ..kernels.gemv.registry import DEFAULT_KERNELS, ROWS_PER_THREAD, Kernels, MmaChoice
from ..kernels.attention.decode import Tiles
from ..kernels.attention.rows import fill_table
from ..kv_cache import KVCache, KVSlot
from ..model.rope import layer_tables
from ..offload.estimate import MissRates
from . import graphs as round_graphs
from .gpu_prefill import prefill_rows
from .linear import Linear
from .moe import MoE
from .overrides import PRODUCT, Overrides
from .round import plan_round
from .round import rows as round_rows
from .scratch import activation_dtype, prefill_scratch
from .store_rounds import StoreRounds, expert_store
from .weights import BlockNames, GPULayer, build_layer, load_head, vectors
from .widths import BUCKETS, MAX_W, bucket_of

__all__ = ["BUCKETS", "MAX_W", "ROWS_PER_THREAD", "GPULayer", "GPUModel", "Linear", "MmaChoice", "MoE", "bucket_of"]


class GPUModel(StoreRounds):
    """Same interface as the reference Transformer: new_cache, forward, verify."""

    def __init__(self, f: GGUFFile, max_len: int, device: str | torch.device = "cuda", graphs: bool | None = None,
                 progress=None, expert_slots: int | None = None, prefill_chunk: int | None = None,
                 cpu_threads: int | None = None, cpu_tier: bool | None = None, fast: bool = False,
                 host_bytes: int | None = None, miss_rates: MissRates | None = None,
                 overrides: Overrides = PRODUCT, kernels: Kernels = DEFAULT_KERNELS):
        """expert_slots: keep the routed experts in an expert store with a bank of this
        many VRAM slots (offload/store.py); None: every expert resident.
        prefill_chunk: rows a call of more than 64 rows runs at a time (config.py).
        cpu_tier / cpu_threads: with a store, CPU workers compute the experts that are not
        in the bank (offload/native; None: config.py, the probe's thread count).
        host_bytes: pinned RAM the store's host tier may hold (None: every expert); the
        layers past it stay in the mapped GGUF file, computed by the CPU workers (offload/mapped.py).
        miss_rates: what a missed expert byte costs a round per tier (the plan's measured rates,
        offload/estimate.py; None: the assumed ones), the speculation gate's price of a column's
        misses (spec/offload_costs.py).
        fast: the model serves fast mode (--fast): without gemv_mma, verify rounds wider than
        overrides.fast_mma_narrow rows run the Q4_K weights on the tensor cores (MmaChoice
        "dp4a": narrower rounds, plain decode among them, are the default's bits); an
        exact verify on it then runs its rows one at a time.
        overrides: the kept experiments' choices (runtime/overrides.py; bench/ and tests pass
        variants); kernels: the registry's entries the plans pick from."""
        o = self.overrides = overrides
        cfg = load_config(f)
        if cfg.rope_dim != cfg.head_dim or cfg.head_dim < 16:
            raise NotImplementedError("the GPU runtime needs full-width RoPE and head_dim >= 16")
        self.cfg: ModelConfig = cfg
        self.device = torch.device(device)
        gemv, moe_gemv = self.decode_gemv, self.moe_gemv = o.decode_gemv, o.moe_gemv
        self.max_len = max_len
        t = f.tensors
        self.store = expert_store(f, cfg, expert_slots, self.device, progress, host_bytes)
        self._fuse_q8 = (o.fuse_q8 and cfg.d_model % 32 == 0 and cfg.head_dim % 32 == 0
                         and (cfg.is_moe or cfg.d_ff % 32 == 0))
        # o and down in runs whose partials the next norm adds (Linear.parts); not with post
        # norms (gemma3): those normalize o's and down's whole outputs before the residual add,
        # nor with o's bias (gpt-oss): added to o's whole output (round.branch_out)
        v = cfg.variant
        split = o.gemv_split and gemv == "i8" and not v.post_norms and not v.attn_out_bias
        if v.ffn_act not in GATED:
            raise NotImplementedError(f"the GPU runtime has no {v.ffn_act} FFN")
        self.gated = GATED[v.ffn_act]         # the dense FFN's gated activation (SiLU, GeGLU: gemma3, swiglu_oai)
        # Q4_K dense weights on the tensor cores (Linear; emulated under the interpreter)
        mma = None
        if o.gemv_mma and gemv == "i8":
            mma = MmaChoice(o.gemv_mma_narrow)
        elif fast and gemv == "i8" and o.fast_mma_narrow < MAX_W:
            mma = MmaChoice(o.fast_mma_narrow, partner="dp4a")
        self.layers = []
        for i in range(cfg.n_layers):
            self.layers.append(build_layer(t, BlockNames(f"blk.{i}."), cfg, self.device, cfg.is_moe, gemv, moe_gemv,
                                           split, mma, kernels, o, self.store, i))
            if progress is not None:
                progress(f"layer {i}", 0)
        self._start_workers([L.moe for L in self.layers if L.moe is not None], cfg.d_model, cfg.n_experts_used,
                            cpu_tier, cpu_threads, host_bytes, miss_rates, progress)
        self.output_norm, self.output, self.embd, self.embd_qtype = load_head(t, self.device, gemv, mma, kernels)
        self.embd_shape = t["token_embd.weight"].shape
        # the reference model's tables (model/rope.py: linear / YaRN / longrope scaling, Llama
        # 3.1's rope_freqs, the magnitude scale), per layer (gemma3's sliding-window layers have
        # their own base): one device copy per distinct table
        factors = {name: vectors(t, "cpu")(name) for name in cfg.variant.rope_factors}
        tables = layer_tables(cfg, max_len + MAX_W, factors, ctx=max_len)     # shared tables: the same objects
        on_device: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ropes: list[tuple[torch.Tensor, torch.Tensor]] = []               # per layer: [max_len+64, hd/2] x2
        for tab in tables:
            if id(tab) not in on_device:
                on_device[id(tab)] = (tab[0].to(self.device), tab[1].to(self.device))
            self.ropes.append(on_device[id(tab)])
        # llama4 / mistral3's query temperature (round.query_temperature)
        self.q_temp = (v.attn_temp_scale, v.attn_temp_floor) if v.attn_temp_scale else None
        # gemma3: the q.k scale (None: 1/sqrt(hd)), each layer's sliding window (0: none),
        # the embedding scale and the final logits' softcap (0: none)
        self.attn_scale = v.attn_scale or None
        self.windows = tuple(v.sliding_window if v.is_swa(i) else 0 for i in range(cfg.n_layers))
        self.embed_scale, self.softcap = v.embed_scale, v.final_softcap
        # bytes one row reads (MoE: k of the E experts), the floor's numerator
        self.weight_bytes = sum(l.nbytes for l in self.layers) + self.output.nbytes
        # fast mode's hybrid: wide rounds are not the bits of narrow ones (verify)
        self.hybrid = any(lin.hybrid for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down, self.output)
                          if lin is not None)
        # graph inputs: one stream's position [1], or (new_cache(slots > 1)) the row table
        # [3, MAX_W] of each row's position, KV base and stream start (kernels/attention/rows.py)
        self._pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._tokens = torch.zeros(MAX_W, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.cache: KVCache | None = None
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        self.act_dtype = activation_dtype(self.device)
        # producers emit the int8 activations (no prepare launch) where the widths allow
        # programmatic dependent launch between the round's kernels (kernels/pdl.py)
        self.pdl = o.pdl and self.device.type == "cuda"
        self.capture_s = 0.0
        self.combine_in_norm, self.norm_router = o.combine_in_norm, o.norm_router
        self.early_kv = o.early_kv    # (the decode round qualifies: kernels/attention/decode.py)
        self.attn_tiles = Tiles(*o.attention_tiles)
        self.prefill_path = o.prefill_path
        self.prefill_chunk = prefill_chunk or DEFAULTS.engine.prefill_chunk
        self.scratch = prefill_scratch(o, self.act_dtype, self.device, o.prefill_graphs)
        # the round of every width, made once (runtime/round.py): what each producer emits, which add
        self.round_plans = tuple(plan_round(self, W) for W in range(1, MAX_W + 1))

    def new_cache(self, max_len: int | None = None, slots: int = 1) -> KVCache:
        """The model's cache (its graphs captured on it). slots > 1 (parallel streams): room
        for `slots` slots of max_len rows (cache.split), and every round takes its rows'
        positions and KV bases from the row table (rows.py), one stream's rounds too."""
        c = self.cfg
        rows = max_len or self.max_len
        if slots < 1 or (slots > 1 and rows > self.max_len):   # (a slot's positions: the RoPE tables')
            raise ValueError(f"a cache of {slots} slots of {rows} rows (this model's positions: {self.max_len})")
        # room for a full padded bucket past the last position: padding rows write there
        cache = KVCache(c.n_layers, c.n_kv_heads, slots * rows + MAX_W, c.head_dim,
                        dtype=torch.float16, device=self.device)
        cache.max_len -= MAX_W
        self.cache = cache
        shape = (1,) if slots == 1 else (3, MAX_W)
        self._pos = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.graphs.clear()
        if self.use_graphs:
            self.capture()
        return cache

    @property
    def per_row(self) -> bool:
        """Do the rounds take the row table (a cache of several slots)?"""
        return self._pos.dim() == 2

    def _seat(self, parts: list[tuple[int, int, KVCache]]) -> KVCache:
        """Set the round's position input for parts [(rows, first position, cache or slot)]
        -> the cache the round writes (a slot's parent)."""
        if not self.per_row:
            (_, pos, cache), = parts
            self._pos.fill_(pos)
            return cache
        parent = parts[0][2].parent if isinstance(parts[0][2], KVSlot) else parts[0][2]
        fill_table(self._pos, [(n, pos, c.base if isinstance(c, KVSlot) else 0) for n, pos, c in parts],
                   parent.max_len)
        return parent

    def _rows(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [W] int64 (device), pos int32 [1] (device) -> (logits [W, V], hidden [W, D])."""
        return round_rows(self, tokens, pos, cache)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] int64 -> their embedding rows [T, D] float32 (the residual)."""
        if isinstance(self.embd, QuantWeight):
            x = gather_rows(self.embd, tokens.to(self.device))   # (a no-op for the rounds' device ids)
        else:
            x = dequantize(self.embd[tokens], self.embd_qtype, (tokens.shape[0], self.cfg.d_model))
        return x if self.embed_scale == 1.0 else x * self.embed_scale      # gemma: times sqrt(d_model)

    def _norm_router(self, L: GPULayer, W: int) -> bool:
        """Does layer L's FFN norm compute its router's logits at width W (overrides.norm_router)?"""
        i = next(i for i, x in enumerate(self.layers) if x is L)   # by identity: == compares tensors
        return self.round_plans[W - 1].layers[i].norm_router

    def capture(self) -> None:
        """One CUDA graph per width bucket, sharing one memory pool (replayed one at a time)."""
        self.capture_s = round_graphs.capture(self)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos: int, cache: KVCache,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows at pos..pos+T-1: up to 64 through a bucket's graph; more (a prompt) through
        the tensor-core prefill path if prefill_path is "dequant" (with an expert store too:
        each hit expert read once per chunk from its slot or the host tier), else in 64-row
        rounds through the graphs. Returns (logits [T, V], hidden [T, D]) on the device; the graph's outputs are
        static buffers, valid until the next call. logits=False returns None for them
        (the graphs compute the head anyway)."""
        T = tokens.shape[0]
        _check_fits(T, pos, cache)
        tokens = tokens.to(self.device)
        if T > MAX_W and self.prefill_path == "dequant":
            return self._prefill(tokens, pos, cache, logits)
        outs = []
        for s in range(0, T, MAX_W):
            part = tokens[s:s + MAX_W]
            W = part.shape[0]
            whole = self._seat([(W, pos + s, cache)])
            self._before_store_round(W)
            if self.use_graphs and whole is self.cache:
                lg, hd = round_graphs.replay(self, part)
                # the graph's outputs are static buffers: later chunks would overwrite them
                outs.append((lg, hd) if T <= MAX_W else (lg.clone(), hd.clone()))
            else:
                outs.append(self._rows(part, self._pos, whole))
            self._after_store_round(W, 1)
        cache.length = pos + T
        if len(outs) == 1:
            out = outs[0]
        else:
            out = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        return (out if logits else (None, out[1]))

    def _prefill(self, tokens: torch.Tensor, pos: int, cache: KVCache,
                 logits: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """T > 64 rows in chunks of prefill_chunk through the tensor-core path (no graphs;
        the head only when logits are asked for)."""
        outs = [prefill_rows(self, tokens[s:s + self.prefill_chunk], pos + s, cache, logits, ROWS_PER_THREAD)
                for s in range(0, tokens.shape[0], self.prefill_chunk)]
        cache.length = pos + tokens.shape[0]
        hidden = torch.cat([o[1] for o in outs]) if len(outs) > 1 else outs[0][1]
        if not logits:
            return None, hidden
        return (torch.cat([o[0] for o in outs]) if len(outs) > 1 else outs[0][0]), hidden

    def verify(self, tokens: torch.Tensor, pos: int, cache: KVCache, exact: bool = True):
        """Every kernel is row-invariant, so exact and fast verify are the same batched pass;
        but a model built for fast mode's hybrid (self.hybrid) gives wide rounds the tensor
        cores' bits, so there an exact verify runs its rows one at a time (plain decode's)."""
        if not (exact and self.hybrid) or tokens.shape[0] == 1:
            return self.forward(tokens, pos, cache)
        rows = []
        for i in range(tokens.shape[0]):     # (the graphs' outputs are static buffers: copied)
            lg, hd = self.forward(tokens[i:i + 1], pos + i, cache)
            rows.append((lg.clone(), hd.clone()))
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    @torch.inference_mode()
    def round(self, parts: list[tuple[torch.Tensor, int, KVCache]], exact: bool = True):
        """Several streams' verify rows, parts [(tokens [w], first position, slot)], side by side
        in passes of up to 64 rows (the row table gives each row its position and KV base)
        -> [(logits [w, V], hidden [w, D])] per part: the bits each part's verify would give
        alone (every kernel is row-invariant). Where rows cannot share a pass (one stream's
        cache, fast mode's hybrid under exact, a part wider than 64 rows) each part is its
        own verify. Outputs are the graphs' static buffers, valid until the next call.
        With an expert store each pass is one of its rounds: the routing of all its rows
        (whatever stream) feeds the policy and the footprint, and it admits for each stream
        it carried (offload/admission.py); an expert's bits are its tier's whichever rows
        pick it (expert-contract.md), so no stream's bits depend on the others' routing."""
        if not self.per_row or (exact and self.hybrid) or len(parts) == 1:
            return [self.verify(t, p, c, exact) for t, p, c in parts]
        outs: list = [None] * len(parts)
        group: list[int] = []
        for i, (t, p, c) in enumerate(parts):
            _check_fits(t.shape[0], p, c)
            if t.shape[0] > MAX_W:
                outs[i] = self.verify(t, p, c, exact)
                continue
            if sum(parts[j][0].shape[0] for j in group) + t.shape[0] > MAX_W:
                self._pass(parts, group, outs, clone=True)
                group = []
            group.append(i)
        if group:
            self._pass(parts, group, outs, clone=any(o is not None for o in outs))
        return outs

    def _pass(self, parts, group: list[int], outs: list, clone: bool) -> None:
        """parts[group] in one pass; outs[i] <- (logits, hidden) of part i (cloned: later passes follow)."""
        tokens = torch.cat([parts[i][0] for i in group]).to(self.device)           # [W]
        whole = self._seat([(parts[i][0].shape[0], parts[i][1], parts[i][2]) for i in group])
        self._before_store_round(tokens.shape[0])
        if self.use_graphs and whole is self.cache:
            lg, hd = round_graphs.replay(self, tokens)
        else:
            lg, hd = self._rows(tokens, self._pos, whole)
        self._after_store_round(tokens.shape[0], len(group))
        r = 0
        for i in group:
            t, p, c = parts[i]
            w = t.shape[0]
            outs[i] = (lg[r:r + w].clone(), hd[r:r + w].clone()) if clone else (lg[r:r + w], hd[r:r + w])
            c.length = p + w
            r += w


def _check_fits(T: int, pos: int, cache: KVCache) -> None:
    if pos > cache.length or pos + T > cache.max_len:
        raise ValueError(f"rows {pos}..{pos + T} do not fit a cache of {cache.length}/{cache.max_len}")

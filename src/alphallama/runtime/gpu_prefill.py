"""Prefill chunks (more than MAX_W rows) through the tensor cores.

The decode round (gpu_model._rows) is a GEMV per weight: right for W <= 64 rows, but a
512-row chunk through it re-reads every weight 8 times on the CUDA cores. Here the
same layer sequence runs eagerly with each quantized matrix dequantized into the
model's scratch and multiplied by cuBLAS (kernels/prefill/qgemm.py), attention by torch SDPA
over the cache prefix (flash, causal aligned bottom-right), and the small fused
kernels as in decode. The chunk's GEMMs are known ahead, so they are handed to the
scratch as a plan: each weight is dequantized while the GEMM before it runs.

MoE layers: the router and the top-k are the decode kernels (a GEMV: the router is
small). With every expert resident the experts run as two grouped GEMMs that
dequantize weight tiles on the fly (kernels/moe/moe_gemm.py, Overrides.moe_prefill_fused): the pairs are
put into padded per-expert blocks on the device, no host sync, so such a model's
chunks are captured as CUDA graphs like a dense model's (several times faster than
batches of dequantized experts with one host sync a layer, or a loop over experts;
docs/decisions/prefill-tensor-cores.md). With an expert store (moe_loop) the
chunk's (row, slot) pairs are grouped by expert (one host sync per layer for the
counts) and each routed expert runs as two GEMMs on its dequantized gate|up and down
over its rows: ~8 launches an expert. Each pair's output is written
once and the k of a row are summed in slot order: deterministic, no atomics. With
an expert store, an expert without a bank slot is dequantized straight from the host
tier (pinned RAM, over PCIe) into the scratch: a long prompt reads each hit expert once
per chunk instead of once per (row, rank) pair, and the bank is not disturbed, so
decode finds it as the policy left it. (The scratch sits inside the plan's reserve.)

These rows' bits differ from what the decode graphs would compute (cuBLAS sums in its
own order, SDPA is not the split-KV kernel); gpu_model.py says what that changes.
"""
from __future__ import annotations

import itertools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..kernels.norm.rmsnorm import add_rmsnorm
from ..kernels.attention.rope import qkv_rope
from ..kernels.activations.silu import GATED
from ..kernels.moe.moe_gemm import moe_prefill
from .round import post_norm, query_temperature, softcap
from .scratch import Scratch
from ..kernels.gemv.qmatmul import qmatmul
from .capture import collector_paused

GRAPH_DEVICES = ("cuda",)   # where prefill chunks are captured (tests stand in for the capture on the CPU)
GRAPH_MIN_ROWS = 128        # graph_rows: the smallest captured chunk


def gemm_linear(lin, x: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """A runtime.linear.Linear through the scratch's GEMMs: x [T, K] -> [T, sum N] float32
    (its matrices of different types share one buffer and one GEMM where they fit)."""
    return scratch.gemm(x, scratch.units(lin.weights))


def plan_from(m, i: int, logits: bool, scratch: Scratch) -> list:
    """The GEMM units from layer i on, in call order, up to the first MoE layer's
    attention output (its experts are known only after routing) or the end."""
    units = []
    for L in m.layers[i:]:
        units += scratch.units(L.qkv.weights) + scratch.units(L.o.weights)
        if L.moe is not None:
            return units + shared_units(L, scratch)
        units += scratch.units(L.gate_up.weights) + scratch.units(L.down.weights)
    return units + (scratch.units(m.output.weights) if logits else [])


def shared_units(L, scratch: Scratch) -> list:
    """The GEMM units of a layer's shared expert (none without one), in call order."""
    sh = L.shared
    return [] if sh is None else scratch.units(sh.gate_up.weights) + scratch.units(sh.down.weights)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, out_dtype: torch.dtype,
                      scale: float | None = None, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, hd] (rows at pos..pos+T-1), k/v [n_kv, max_len, hd] with rows 0..pos+T-1
    written -> [T, H * hd] in out_dtype. Row t sees keys 0..pos+t; with window > 0 (a
    sliding-window layer) only keys pos+t-window < j <= pos+t. scale: of q.k (None: 1/sqrt(hd)).
    sinks [H] fp32 (gpt-oss): each head's sink logit joins the softmax's denominator, as a
    key 0 before the real ones that every row sees, whose value is zero (_with_sink_key)."""
    T, H, hd = q.shape
    n_kv, L = k.shape[0], pos + T
    dt = k.dtype if q.is_cuda else torch.float32          # fp16 tensor cores; fp32 on CPU
    # 4-D: torch's fused kernels (flash, mem-efficient) take only [B, H, T, hd]; on 3-D
    # inputs SDPA falls back to its math path (fp32 bmm + softmax, far slower)
    qh = q.transpose(0, 1).to(dt)[None]                          # [1, H, T, hd]
    kk = k[:, :L].to(dt).repeat_interleave(H // n_kv, 0)[None]   # [1, H, L, hd]
    vv = v[:, :L].to(dt).repeat_interleave(H // n_kv, 0)[None]   # [1, H, L, hd]
    lead = 0                                                     # keys before the real ones
    if sinks is not None:     # (the scale then named: SDPA's default would be the wider head's)
        scale = hd ** -0.5 if scale is None else scale
        qh, kk, vv = _with_sink_key(qh, kk, vv, sinks, scale)
        lead = 1
    if window and pos + T > window:     # some row's window starts past key 0: an explicit mask
        p = pos + torch.arange(T, device=q.device)[:, None]                     # [T, 1] each row's position
        j = torch.arange(-lead, L, device=q.device)[None, :]                    # [1, lead + L]
        mask = ((j <= p) & (p - j < window)) | (j < 0)                          # the sink key: every row's
        o = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=mask, scale=scale)
    elif pos == 0 and not lead:
        o = F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=scale)  # [1, H, T, hd]
    else:
        # is_causal aligns the triangle top-left; with a prefix (or the sink key) it sits
        # bottom-right, which the flash kernel takes as such (an explicit mask would rule flash out)
        o = F.scaled_dot_product_attention(qh, kk, vv, attn_mask=causal_lower_right(T, lead + L), scale=scale)
    return o[0, :, :, :hd].transpose(0, 1).reshape(T, H * hd).to(out_dtype)  # [T, H*hd]


SINK_PAD = 8   # head-dim columns the sink key adds (the fused kernels take multiples of 8)


def _with_sink_key(qh: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([1, H, T, hd], [1, H, L, hd] x2) -> the same with SINK_PAD more columns and one key
    first: q's new columns (1, 1, 0, ...), the real keys' zeros (their scores unchanged: + 0),
    the sink key's (hi, lo, 0, ...) with hi + lo = sinks[h] / scale split in the inputs' type
    (fp16: one rounding would be ~1e-3 of the logit), so its score after the scale is the sink
    logit; its value is zero, so it adds exp(sink) to the denominator only."""
    _, H, T, hd = qh.shape
    s = (sinks.double() / scale).view(H, 1)                                     # [H, 1]
    hi = s.to(qh.dtype)
    lo = (s - hi.double()).to(qh.dtype)
    ones = torch.zeros(1, H, T, SINK_PAD, dtype=qh.dtype, device=qh.device)
    ones[..., :2] = 1
    sink_k = torch.zeros(1, H, 1, hd + SINK_PAD, dtype=qh.dtype, device=qh.device)
    sink_k[0, :, 0, hd:hd + 2] = torch.cat([hi, lo], 1)
    pad = kk.new_zeros(1, H, kk.shape[2], SINK_PAD)
    kk = torch.cat([sink_k, torch.cat([kk, pad], 3)], 2)                        # [1, H, 1 + L, hd + 8]
    vv = torch.cat([torch.zeros_like(sink_k), torch.cat([vv, pad], 3)], 2)      # [1, H, 1 + L, hd + 8]
    return torch.cat([qh, ones], 3), kk, vv                                     # q: [1, H, T, hd + 8]


def moe_grouped(moe, h: torch.Tensor, scratch: Scratch, rows_per_thread: int) -> torch.Tensor:
    """A runtime.moe.MoE over a chunk: [T, D] -> [T, D] fp32. Resident experts through
    moe_gemm.moe_prefill (moe.prefill_fused: no host sync); an expert store's (or prefill_fused off)
    through moe_loop, one expert at a time from the scratch."""
    logits = qmatmul(h, moe.router, rows_per_thread=rows_per_thread)           # [T, E]
    weights, experts = moe.route(logits)                                       # [T, k] each
    if moe_fused(moe):
        biases = None if moe.gate_up_bias is None else (moe.gate_up_bias, moe.down_bias)
        return moe_prefill(h.to(scratch.dtype), weights, experts, moe.gate_up, moe.down, biases=biases, act=moe.act)
    return moe_loop(moe, h, weights, experts, scratch)


def moe_fused(moe) -> bool:
    """Does this MoE layer's chunk go through moe_prefill (no host sync) rather than moe_loop?"""
    return moe.prefill_fused and moe.store is None


def moe_loop(moe, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """The routed rows (weights, experts [T, k]) of h [T, D] through their experts one
    expert at a time -> [T, D] fp32. With an expert store each hit expert is dequantized
    from its bank slot or, if it has none, straight from the host tier over PCIe: once
    per chunk, not once per (row, rank) pair as the decode kernels would read it. The bank
    is left as it is; the chunk's routing goes to the admission policy (learn_prompt), so
    the first decode rounds admit the prompt's experts."""
    T = h.shape[0]
    flat = experts.flatten().long()                                            # [T * k]
    E = moe.router.N
    order = torch.argsort(flat, stable=True)                                   # [T * k] pairs grouped by expert
    counts = torch.bincount(flat, minlength=E)                                 # [E]
    if moe.store is not None:   # the slots and the policy's prompt counts come back with the counts: one host sync
        age = torch.arange(T - 1, -1, -1, device=h.device, dtype=torch.float64)   # [T] rows after each row
        recency = (moe.store.policy.decay ** age).repeat_interleave(moe.top_k)    # [T * k]
        learned = torch.bincount(flat, weights=recency, minlength=E)              # [E]
        both = torch.cat([counts.double(), moe.store.table[moe.layer].double(), learned]).tolist()
        counts, slots = [int(c) for c in both[:E]], [int(s) for s in both[E:2 * E]]
        moe.store.learn_prompt(moe.layer, both[2 * E:], T)
    else:
        counts, slots = counts.tolist(), [-1] * E
    starts = [0, *itertools.accumulate(counts)]
    hit = [e for e, n in enumerate(counts) if n]
    ws = [moe.expert_weights(e, slots[e]) for e in hit]                        # (gate_up [2F, D], down [D, F])
    y = torch.empty(T * moe.top_k, ws[0][1].N, dtype=torch.float32, device=h.device)  # [T * k, D]
    units = [(scratch.units([gu], cache=False), scratch.units([dn], cache=False)) for gu, dn in ws]
    scratch.expect([u for gu_dn in units for part in gu_dn for u in part])
    gated = GATED[moe.gating.act]
    for e, (gu_units, dn_units) in zip(hit, units):
        pairs = order[starts[e]:starts[e] + counts[e]]                         # [n] (row, slot) pairs
        gu = scratch.gemm(h[pairs // moe.top_k], gu_units)                     # [n, 2F]
        if moe.gate_up_bias is not None:                                       # gpt-oss's biases
            gu = gu + moe.gate_up_bias[e]
        y[pairs] = scratch.gemm(gated.plain(gu, scratch.dtype), dn_units)      # [n, D]
        if moe.down_bias is not None:
            y[pairs] += moe.down_bias[e]
    return (y.view(T, moe.top_k, -1) * weights[:, :, None]).sum(1)            # [T, D]


def _segment(m, i: int, x: torch.Tensor, a: torch.Tensor | None, pos_t: torch.Tensor, cache, logits: bool,
             rows_per_thread: int | None = None, plan: bool = True):
    """Between two attentions: layer i-1 from its attention output a (i > 0), then layer
    i up to its roped q [T, H, hd] (its K/V written at pos_t), or for i = n_layers the
    head (logits [T, V] or None). x [T, D] fp32 is the residual, updated in place.
    plan: hand the scratch the GEMMs up to the next MoE layer's experts where they start
    (False: the caller plans, e.g. one stretch at a time)."""
    c, s, act = m.cfg, m.scratch, m.scratch.dtype
    if i == 0:
        h = add_rmsnorm(x, None, m.layers[0].attn_norm, c.norm_eps, act)                 # [T, D]
    else:
        L = m.layers[i - 1]
        o = gemm_linear(L.o, a, s)                                                       # [T, D]
        o = post_norm(m, o if L.o_bias is None else o + L.o_bias, L.post_attn_norm)
        h = add_rmsnorm(x, o, L.ffn_norm, c.norm_eps, act)                               # x += o(a)
        if L.moe is not None:
            d = moe_grouped(L.moe, h, s, rows_per_thread)                                 # [T, D]
            if L.shared is not None:
                d = d + L.shared(h, act, gemm=lambda lin, y: gemm_linear(lin, y, s))             # [T, D]
        else:
            gu = gemm_linear(L.gate_up, h, s)                                              # [T, 2F]
            d = gemm_linear(L.down, m.gated.plain(gu, act), s)                            # [T, D]
        d = post_norm(m, d, L.post_ffn_norm)
        nxt = m.layers[i].attn_norm if i < len(m.layers) else m.output_norm
        h = add_rmsnorm(x, d, nxt, c.norm_eps, act)
    if plan and (i == 0 or m.layers[i - 1].moe is not None):
        s.plan(plan_from(m, i, logits, s))           # the GEMMs up to the next MoE layer's experts
    if i == len(m.layers):
        return softcap(gemm_linear(m.output, h, s), m.softcap) if logits else None
    L = m.layers[i]
    qkv = gemm_linear(L.qkv, h, s)                                                       # [T, (H + 2 n_kv) hd]
    cos, sin = m.ropes[i]
    q = qkv_rope(qkv, L.qkv_bias, L.q_norm, L.k_norm, cos, sin, cache.k[i], cache.v[i], pos_t,
                 c.n_heads, c.n_kv_heads, c.head_dim, c.norm_eps, c.rope_neox)            # [T, H, hd]
    return q if m.q_temp is None else query_temperature(q, pos_t, *m.q_temp)


def _warm_up(fn, device) -> None:
    """fn() once on a side stream, waited for (as gpu_model.capture warms up)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def _graph_pool():
    return torch.cuda.graph_pool_handle()


def _capture(fn, pool):
    """fn's launches as a CUDA graph -> (replay, fn's output: a static tensor or None).
    capture_begin/end on a side stream rather than torch.cuda.graph(), whose entry
    synchronizes and empties the allocator's cache: once per stretch, n_layers + 1 times.
    The cyclic collector is paused meanwhile (capture.collector_paused)."""
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with collector_paused(), torch.cuda.stream(stream):
        g.capture_begin(pool=pool)
        try:
            out = fn()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return g.replay, out


def _stretch_units(m, i: int, logits: bool, s: Scratch) -> list:
    """The GEMM units of _segment(i) in call order (an MoE layer's experts use no scratch:
    moe_prefill)."""
    units = []
    if i > 0:
        L = m.layers[i - 1]
        units += s.units(L.o.weights)
        if L.moe is None:
            units += s.units(L.gate_up.weights) + s.units(L.down.weights)
        units += shared_units(L, s)
    if i < len(m.layers):
        return units + s.units(m.layers[i].qkv.weights)
    return units + (s.units(m.output.weights) if logits else [])


class ChunkGraphs:
    """A prefill chunk of T rows as CUDA graphs (dense layers, and MoE layers through
    moe_prefill: nothing syncs the host), for one KV cache: one graph
    per stretch between two attentions (_segment), attention eagerly in between (its
    shapes change with the position). The host then issues n_layers + 1 replays and the
    attentions instead of ~60 launches a layer (an eager chunk takes the host longer to
    issue than the GPU takes to run it; docs/decisions/prefill-tensor-cores.md). Static
    inputs: the residual x, the position, the attention output a; each graph's output is
    the next attention's q (the last one's: the logits or None). With the scratch's overlap, each
    graph holds its own stretch's dequantize-ahead on the side stream."""

    def __init__(self, m, cache, T: int, logits: bool, pos: int, rows_per_thread: int):
        c = m.cfg
        # not the model itself: the model's scratch keeps this object (Scratch.captured), and a
        # reference back would make a cycle that only the cyclic collector frees, resetting
        # the graphs wherever it runs, inside another capture too (runtime/capture.py)
        self.n_layers, self.cache, self.logits, self.T = len(m.layers), cache, logits, T
        self.scale, self.windows, self.sinks = m.attn_scale, m.windows, [L.sinks for L in m.layers]
        self.x = torch.zeros(T, c.d_model, dtype=torch.float32, device=m.device)               # [T, D]
        self.pos = torch.full((1,), pos, dtype=torch.int32, device=m.device)  # warm-up writes K/V rows the chunk owns
        self.a = torch.zeros(T, c.n_heads * c.head_dim, dtype=m.scratch.dtype, device=m.device)  # [T, H*hd]
        n, s = len(m.layers), m.scratch

        def seg(i):
            # one plan per graph (with overlap, the side stream forks from the capture at
            # the plan and joins it at the end: a graph holds all of its stretch's work)
            s.plan(_stretch_units(m, i, logits, s))
            out = _segment(m, i, self.x, self.a if i else None, self.pos, cache, logits, rows_per_thread, plan=False)
            s.join()
            return out
        _warm_up(lambda: [seg(i) for i in range(n + 1)], m.device)   # compiles every kernel first
        pool = _graph_pool()                             # shared: replayed in capture order
        self.replays, self.outs = [], []
        for i in range(n + 1):
            replay, out = _capture(lambda i=i: seg(i), pool)
            self.replays.append(replay)
            self.outs.append(out)

    def run(self, x: torch.Tensor, pos: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x [T, D] fp32 (the embedded rows) at pos.. -> (logits or None, x after the last layer):
        fresh tensors (the graphs' own are overwritten by the next chunk)."""
        self.x.copy_(x)
        self.pos.fill_(pos)
        for i in range(self.n_layers):
            self.replays[i]()
            self.a.copy_(prefill_attention(self.outs[i], self.cache.k[i], self.cache.v[i], pos, self.a.dtype,
                                           self.scale, self.windows[i], self.sinks[i]))
        self.replays[-1]()
        logits = self.outs[-1]
        return (logits.clone() if logits is not None else None), self.x.clone()


def capturable(L) -> bool:
    """A layer whose chunk needs no host sync: dense, or MoE through moe_prefill."""
    return L.moe is None or moe_fused(L.moe)


def graph_rows(T: int, chunk: int) -> int:
    """The rows a chunk of T rows runs as in the graphs: the chunk size, or for a shorter
    one (a prompt's last or only chunk) the smallest power of two from GRAPH_MIN_ROWS up
    that holds it; the padding rows' K/V land past the real rows (overwritten later, as
    in the decode graphs). A model keeps a few shapes: 128, 256, 512 at the defaults."""
    return min(chunk, max(GRAPH_MIN_ROWS, 1 << (T - 1).bit_length()))


def _graphs_for(m, cache, T: int, logits: bool, pos: int, rows_per_thread: int) -> ChunkGraphs | None:
    """The captured chunk of graph_rows(T) rows for these shapes and this cache (captured
    on first use; kept per shape for one cache), or None where graphs do not apply."""
    s = m.scratch
    if not (s.graphs and m.device.type in GRAPH_DEVICES and all(map(capturable, m.layers))):
        return None
    Tg = graph_rows(T, m.prefill_chunk)
    if pos + Tg > cache.max_len:                         # the padding would pass the cache's end
        return None
    s.units(m.layers[0].o.weights)                       # buffers allocated before any capture
    where = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape))   # the graphs hold these addresses
    storage = cache.k.untyped_storage().data_ptr()       # the slots of one cache (-np N) keep theirs
    key = (Tg, logits, storage, *where)
    if key not in s.captured:
        for k in [k for k in s.captured if k[2] != storage]:
            del s.captured[k]                            # another cache's
        try:
            s.captured[key] = ChunkGraphs(m, cache, Tg, logits, pos, rows_per_thread)   # (MoE: the router's)
        except Exception as e:  # noqa: BLE001 - a capture the runtime refuses: the eager path is always there
            s.graphs = False    # (the warm-up wrote only K/V rows this chunk is about to write again)
            warnings.warn(f"prefill CUDA graphs off: capture failed ({e!r})", RuntimeWarning, stacklevel=2)
            return None
    return s.captured[key]


def prefill_rows(m, tokens: torch.Tensor, pos: int, cache, logits: bool,
                 rows_per_thread: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One chunk: tokens [T] int64 (device) at pos..pos+T-1 of `cache` (GPUModel `m`)
    -> (logits [T, V] float32 or None, hidden [T, D])."""
    T = tokens.shape[0]
    s = m.scratch
    graphs = _graphs_for(m, cache, T, logits, pos, rows_per_thread)
    if graphs is not None and graphs.T > T:                                  # padding rows: token 0
        tokens = torch.cat([tokens, tokens.new_zeros(graphs.T - T)])
    x = m.embed(tokens)                                                      # [T (padded), D] fp32 residual
    if graphs is not None:
        lg, h = graphs.run(x, pos)
        return (lg[:T] if lg is not None else None), h[:T]
    pos_t = torch.full((1,), pos, dtype=torch.int32, device=m.device)      # a fill, not a synchronous copy
    a = None
    for i in range(len(m.layers)):
        q = _segment(m, i, x, a, pos_t, cache, logits, rows_per_thread)     # [T, H, hd]
        a = prefill_attention(q, cache.k[i], cache.v[i], pos, s.dtype, m.attn_scale, m.windows[i],
                              m.layers[i].sinks)                                                 # [T, H*hd]
    return _segment(m, len(m.layers), x, a, pos_t, cache, logits, rows_per_thread), x

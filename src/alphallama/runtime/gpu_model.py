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

import os
import threading
import time
from dataclasses import dataclass

import torch

from ..gguf.arch import ModelConfig, load_config
from ..gguf.quants import dequantize
from ..gguf.reader import GGUFFile, TensorInfo
from ..kernels.moe.moe_f32 import MoEParts
from ..kernels.moe.moe_f32 import moe_down, moe_gate_up
from ..kernels.moe.route import moe_route
from ..kernels.moe.moe_i8 import moe_down_i8, moe_gate_up_i8, moe_i8_ok, moe_i8_order
from ..kernels.moe.moe_q8 import contract_ok, moe_q8
from ..kernels.gemv.qgemv_i8 import qgemv_i8
from ..kernels.gemv.registry import (DEFAULT_KERNELS, ROWS_PER_THREAD, Kernels, MmaChoice, mma_planes_of,
                                     plan_linear)
from ..kernels.gemv.qmatmul import qmatmul
from ..kernels.gemv.qmatvec_i8 import lane_order, prepare_i8
from ..kernels.formats.qweight import QuantWeight, embedding_planes
from ..model.layers import rope_tables
from ..config import DEFAULTS
from .scratch import Scratch
from ..kernels.formats.dequant import gather_rows
from ..offload.cpu_tier import CpuLink
from ..offload.mailbox import Mailbox
from ..offload.store import ExpertStore, pack_experts
from .capture import collector_paused
from .gpu_prefill import prefill_rows
from .kv_cache import KVCache
from .overrides import PRODUCT, Overrides
from .round import plan_round
from .round import rows as round_rows

BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MAX_W = BUCKETS[-1]


def bucket_of(w: int) -> int:
    return next(b for b in BUCKETS if b >= w)


def _concat_rows(parts: list[TensorInfo]) -> tuple[torch.Tensor, tuple[int, int]]:
    """GGUF rows are independent runs of blocks: stacking the bytes stacks the matrices."""
    raw = torch.cat([torch.from_numpy(p.data.reshape(p.shape[0], -1).view("uint8").copy()) for p in parts])
    return raw, (sum(p.shape[0] for p in parts), parts[0].shape[1])


class Linear:
    """One or more GGUF matrices applied to the same input; outputs concatenated.
    Matrices of the same type are fused into one weight (one launch). Which GEMV runs
    each weight at each width is its plan (kernels/gemv/registry.py), made here once.

    gemv "i8": the input is quantized to int8 once per lane order (kernels/gemv/qmatvec_i8:
    one order per slot shape, shared by e.g. Q4_K and Q5_K) and each weight's dp4a GEMV
    writes its columns of one output buffer (no concatenation); weights without an
    integer form (F16, F32) take qmatmul."""

    def __init__(self, parts: list[TensorInfo], device, gemv: str = "f32", split: bool = False,
                 mma: MmaChoice | None = None, kernels: Kernels = DEFAULT_KERNELS,
                 split_limits: tuple[int, int] = PRODUCT.split_limits):
        """split: parts() may give partial sums (qgemv_i8.split_runs) for a norm to add.
        mma: the weights qgemv_mma_k (Q4_K) covers run there (engine.gemv_mma), on q8_K
        activations (one scale a super-block) that its producer emits (orders:
        qgemv_mma.Q8K) or this Linear prepares; rounds of up to mma.narrow rows take the
        format's dp4a partner (qgemv_q8k: the same bits)."""
        groups: list[list[TensorInfo]] = []
        for p in parts:
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.weights = []
        for g in groups:
            raw, shape = _concat_rows(g)
            self.weights.append(QuantWeight.from_raw(raw, g[0].qtype, shape, device))
        self.nbytes = sum(w.nbytes for w in self.weights)
        self.plan = plan_linear(self.weights, gemv, split, mma, MAX_W, kernels=kernels, split_limits=split_limits)
        self.i8, self.mma = list(self.plan.i8), list(self.plan.mma)
        # fast mode's hybrid: rounds of up to mma.narrow rows run as if there were no mma at all
        self.hybrid = self.plan.hybrid
        # the code planes again in the mma's fragment order (the prefill path reads the planes as they
        # are): more memory held, the same bytes read a round (nbytes, the floor's numerator)
        self._planes = mma_planes_of(self.weights, self.plan)
        self.N = sum(w.N for w in self.weights)
        runs = max(s.runs for s in self.plan.steps)
        # the runs' unit weights for the norm's add (norm.add_rmsnorm's MoE-ranks path): [MAX_W, runs]
        self._ones = torch.ones((MAX_W, runs), dtype=torch.float32, device=device) if runs > 1 else None

    def orders(self, W: int) -> tuple:
        """The activation layouts a round of W rows reads (its producer can emit them)."""
        return self.plan.at(W).orders

    def adds(self, W: int) -> bool:
        """Can add_into run at width W: one weight on dp4a (its epilogue adds)."""
        return self.plan.at(W).adds

    def runs(self, W: int) -> int:
        """parts()'s partial sums at width W (1: one [W, N] sum)."""
        return self.plan.at(W).runs

    def add_into(self, x: torch.Tensor, q8: dict | None, out: torch.Tensor, pdl: bool = False) -> None:
        """out += x @ w^T in the GEMV's epilogue (one weight, i8: self.adds): the residual
        stream's add, bit for bit the norm's x + y."""
        w = self.weights[0]
        qgemv_i8(x, w, out=out, prepared=(q8 or {}).get(lane_order(w)), pdl=pdl, accumulate=True)

    def parts(self, x: torch.Tensor, q8: dict | None = None, pdl: bool = False) -> "torch.Tensor | MoEParts":
        """x @ w^T for a norm to add into the residual: [W, N], or with runs (self.runs > 1)
        (the runs' partial sums [W, runs, N], their unit weights [W, runs]), which the norm
        adds in run order as it adds MoE ranks (more programs for a short matrix)."""
        runs = self.runs(x.shape[0])
        if runs == 1:
            return self(x, q8, pdl)
        w = self.weights[0]
        part = qgemv_i8(x, w, prepared=(q8 or {}).get(lane_order(w)), pdl=pdl, split=runs)   # [W, runs, N]
        return part, self._ones[:x.shape[0]]

    def __call__(self, x: torch.Tensor, q8: dict | None = None, pdl: bool = False) -> torch.Tensor:
        """x [W, K] -> [W, N] fp32; q8: x's int8 activations by layout, if its producer
        made them (else they are made here, one prepare launch per layout)."""
        if not any(self.i8):
            outs = [qmatmul(x, w, rows_per_thread=ROWS_PER_THREAD) for w in self.weights]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        out = torch.empty((x.shape[0], self.N), dtype=torch.float32, device=x.device)   # [W, N]
        prepared: dict = dict(q8 or {})
        n0 = 0
        for w, k, planes in zip(self.weights, self.plan.at(x.shape[0]).kernels, self._planes):
            key = k.key(w)
            if key is not None and key not in prepared:
                prepared[key] = k.prepare(x, w, pdl)
            k.run(x, w, out[:, n0:n0 + w.N], prepared.get(key), planes, pdl)
            n0 += w.N
        return out


class MoE:
    """Routed experts: router [E, D] (F32 in GGUF files, through qmatmul: row-invariant,
    unlike a cuBLAS GEMM whose kernel may change with W), gate|up fused along N per
    expert [E, 2F, D], down [E, D, F]. With an expert store (offload/store.py) the
    experts live there: the kernels take each from its VRAM slot or the host tier."""

    def __init__(self, router: TensorInfo, gate: TensorInfo, up: TensorInfo, down: TensorInfo, top_k: int,
                 norm: bool, device, store: ExpertStore | None = None, layer: int = 0, gemv: str = "f32",
                 prefill_fused: bool = PRODUCT.moe_prefill_fused):
        E = gate.shape[0]
        self.router = QuantWeight.from_raw(router.data, router.qtype, tuple(router.shape), device)
        # the router as a plain [E, D] float matrix, where it is one (F32/F16/BF16: its qs plane),
        # for the norm that computes the logits itself (engine.norm_router)
        qs = self.router.planes["qs"]
        self.router_rows = qs if qs.dtype.is_floating_point and tuple(qs.shape) == tuple(router.shape) else None
        self.store, self.layer = store, layer
        self.link: CpuLink | None = None   # set by GPUModel when the CPU workers serve the host tier
        if store is None:
            self.gate_up, self.down = pack_experts(gate, up, down, device)
            expert_bytes = self.gate_up.nbytes + self.down.nbytes
        else:
            v = store.layer(layer)
            expert_bytes = v.host_gate_up.nbytes + v.host_down.nbytes
        self.top_k, self.norm = top_k, norm
        self.prefill_fused = prefill_fused   # resident experts' prefill chunks through moe_gemm.moe_prefill
        # gemv "i8": the experts' GEMVs on int8 activations (kernels/moe/moe_i8.py), the layer's
        # input in gate_up's lane order (its norm can emit it: Linear.orders says the same)
        gu, dn = (self.gate_up, self.down) if store is None else (v.host_gate_up, v.host_down)
        self.i8 = gemv == "i8" and moe_i8_ok(gu, dn)
        self._orders = (moe_i8_order(gu),) if self.i8 else ()
        # what one row reads: the router and k of the E experts
        self.nbytes = self.router.nbytes + expert_bytes * top_k // E

    def orders(self, W: int) -> tuple:
        """The activation layouts its norm emits (gate_up's lane order), at every W."""
        return self._orders

    def expert_weights(self, e: int, slot: int = -1) -> tuple[QuantWeight, QuantWeight]:
        """Expert e's (gate_up [2F, D], down [D, F]): resident, else from bank slot `slot`
        (>= 0) or the store's host tier."""
        if self.store is None:
            return self.gate_up.expert(e), self.down.expert(e)
        v = self.store.layer(self.layer)
        if slot >= 0:
            return v.bank_gate_up.expert(slot), v.bank_down.expert(slot)
        return v.host_gate_up.expert(e), v.host_down.expert(e)

    def __call__(self, h: torch.Tensor, act_dtype: torch.dtype, q8: dict | None = None,
                 pdl: bool = False, combine: bool = True,
                 logits: torch.Tensor | None = None) -> "torch.Tensor | MoEParts":
        """h [W, D] -> [W, D] fp32; q8: h's int8 activations by lane order, if made. pdl:
        the int8 path's kernels launch with programmatic dependent launch (kernels/pdl.py;
        the router asks for its weights before it waits: PDL mode 2). combine=False: the
        int8 path may return its ranks unsummed, (part [W, k, D],
        weights [W, k]), for the next norm to sum (fused.add_rmsnorm). logits: the router's [W, E], if the
        norm made them (engine.norm_router; the int8 path only)."""
        if self.i8 and self.link is None:
            if logits is None:
                logits = qmatmul(h, self.router, rows_per_thread=ROWS_PER_THREAD, pdl=2 if pdl else 0)   # [W, E]
            return self._experts_i8(h, logits, act_dtype, q8, pdl, combine)
        logits = qmatmul(h, self.router, rows_per_thread=ROWS_PER_THREAD)        # [W, E]
        if self.store is None:
            weights, experts = moe_route(logits, self.top_k, self.norm)           # [W, k] each
            act = moe_gate_up(h, self.gate_up, experts, act_dtype, rows_per_thread=ROWS_PER_THREAD)  # [W, k, F]
            return moe_down(act, self.down, experts, weights, rows_per_thread=ROWS_PER_THREAD)
        v = self.store.layer(self.layer)
        # the ids also land in the store's record of the round (its admission policy)
        weights, experts = moe_route(logits, self.top_k, self.norm,
                                     experts_out=self.store.routes[self.layer, :h.shape[0]])
        if self.link is not None:   # the expert contract: the CPU takes host pairs, same bits as the GPU
            return moe_q8(h, weights, experts, v.host_gate_up, v.host_down, v.bank_gate_up, v.bank_down, v.table,
                          self.layer, self.link)
        act = moe_gate_up(h, v.host_gate_up, experts, act_dtype, ROWS_PER_THREAD, v.table, v.bank_gate_up)
        return moe_down(act, v.host_down, experts, weights, ROWS_PER_THREAD, v.table, v.bank_down)

    def _experts_i8(self, h: torch.Tensor, logits: torch.Tensor, act_dtype: torch.dtype,
                    q8: dict | None, pdl: bool, combine: bool) -> "torch.Tensor | MoEParts":
        x8 = (q8 or {}).get(self._orders[0])
        if self.store is None:
            gu, dn, table, bgu, bdn, record = self.gate_up, self.down, None, None, None, None
        else:       # the ids also land in the store's record of the round
            v = self.store.layer(self.layer)
            gu, dn, table, bgu, bdn = v.host_gate_up, v.host_down, v.table, v.bank_gate_up, v.bank_down
            record = self.store.routes[self.layer, :h.shape[0]]
        weights, experts = moe_route(logits, self.top_k, self.norm, experts_out=record, pdl=pdl)   # [W, k] each
        x8 = x8 or prepare_i8(h, gu.expert(0), pdl)
        act = moe_gate_up_i8(x8, gu, experts, act_dtype, table, bgu, pdl)        # [W, k, F]
        return moe_down_i8(act, dn, experts, weights, table, bdn, pdl, combine)


@dataclass
class GPULayer:
    attn_norm: torch.Tensor
    qkv: Linear
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear | None       # dense FFN
    down: Linear | None
    moe: MoE | None = None       # routed experts instead

    @property
    def nbytes(self) -> int:
        ffn = self.moe.nbytes if self.moe is not None else self.gate_up.nbytes + self.down.nbytes
        return self.qkv.nbytes + self.o.nbytes + ffn


class GPUModel:
    """Same interface as the reference Transformer: new_cache, forward, verify."""

    def __init__(self, f: GGUFFile, max_len: int, device: str | torch.device = "cuda", graphs: bool | None = None,
                 progress=None, expert_slots: int | None = None, prefill_chunk: int | None = None,
                 cpu_threads: int | None = None, cpu_tier: bool | None = None, fast: bool = False,
                 overrides: Overrides = PRODUCT, kernels: Kernels = DEFAULT_KERNELS):
        """expert_slots: keep the routed experts in an expert store with a bank of this
        many VRAM slots (offload/store.py); None: every expert resident.
        prefill_chunk: rows a call of more than 64 rows runs at a time (config.py).
        cpu_tier / cpu_threads: with a store, CPU workers compute the experts that are not
        in the bank (offload/native; None: config.py, the probe's thread count).
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
        vec = lambda name: dequantize(t[name].data, t[name].qtype, t[name].shape).to(self.device)  # noqa: E731
        self.store: ExpertStore | None = None
        if cfg.is_moe and expert_slots is not None:
            exps = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
            self.store = ExpertStore({i: tuple(t[f"blk.{i}.{n}.weight"] for n in exps) for i in range(cfg.n_layers)},
                                     cfg.n_layers, cfg.n_experts, cfg.n_experts_used, expert_slots, self.device,
                                     MAX_W, progress)
        self._fuse_q8 = (o.fuse_q8 and cfg.d_model % 32 == 0 and cfg.head_dim % 32 == 0
                         and (cfg.is_moe or cfg.d_ff % 32 == 0))
        # o and down in runs whose partials the next norm adds (Linear.parts)
        split = o.gemv_split and gemv == "i8"
        # Q4_K dense weights on the tensor cores (Linear; emulated under the interpreter)
        mma = None
        if o.gemv_mma and gemv == "i8":
            mma = MmaChoice(o.gemv_mma_narrow)
        elif fast and gemv == "i8" and o.fast_mma_narrow < MAX_W:
            mma = MmaChoice(o.fast_mma_narrow, partner="dp4a")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([vec(p + f"attn_{n}.bias") for n in "qkv"])
            moe, dense = None, not cfg.is_moe
            if cfg.is_moe:
                moe = MoE(t[p + "ffn_gate_inp.weight"], t[p + "ffn_gate_exps.weight"], t[p + "ffn_up_exps.weight"],
                          t[p + "ffn_down_exps.weight"], cfg.n_experts_used, cfg.norm_topk_prob, self.device,
                          self.store, i, moe_gemv, o.moe_prefill_fused)
            self.layers.append(GPULayer(
                attn_norm=vec(p + "attn_norm.weight"),
                qkv=Linear([t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]], self.device, gemv,
                           mma=mma, kernels=kernels),
                qkv_bias=bias,
                q_norm=vec(p + "attn_q_norm.weight") if cfg.qk_norm else None,
                k_norm=vec(p + "attn_k_norm.weight") if cfg.qk_norm else None,
                o=Linear([t[p + "attn_output.weight"]], self.device, gemv, split=split, mma=mma, kernels=kernels,
                         split_limits=o.split_limits),
                ffn_norm=vec(p + "ffn_norm.weight"),
                gate_up=Linear([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]], self.device, gemv, mma=mma,
                               kernels=kernels)
                if dense else None,
                down=Linear([t[p + "ffn_down.weight"]], self.device, gemv, split=split, mma=mma, kernels=kernels,
                            split_limits=o.split_limits)
                if dense else None,
                moe=moe,
            ))
            if progress is not None:
                progress(f"layer {i}", 0)
        self.cpu_link: CpuLink | None = None
        self.cpu_experts = None
        self._launch_cpus: set[int] = set()
        self._pinned_threads: set[int] = set()
        if self.store is not None and (DEFAULTS.offload.cpu_tier if cpu_tier is None else cpu_tier):
            self._start_cpu_tier(cpu_threads, progress)
        self.output_norm = vec("output_norm.weight")
        self.output = Linear([t.get("output.weight") or t["token_embd.weight"]], self.device, gemv, mma=mma,
                             kernels=kernels)
        emb = t["token_embd.weight"]
        self.embd_qtype, self.embd_shape = emb.qtype, emb.shape
        # planes, gathered by one kernel (a tied head's own planes); a format without
        # planes keeps its raw rows [V, row_bytes], dequantized by plain torch
        if not embedding_planes(emb.qtype):
            self.embd = torch.from_numpy(emb.data.reshape(emb.shape[0], -1).view("uint8").copy()).to(self.device)
        elif "output.weight" not in t:
            self.embd = self.output.weights[0]
        else:
            self.embd = QuantWeight.from_raw(emb.data, emb.qtype, tuple(emb.shape), self.device)
        cos, sin = rope_tables(max_len + MAX_W, cfg.rope_dim, cfg.rope_base)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)              # [max_len+64, hd/2]
        # bytes one row reads (MoE: k of the E experts), the floor's numerator
        self.weight_bytes = sum(l.nbytes for l in self.layers) + self.output.nbytes
        # fast mode's hybrid: wide rounds are not the bits of narrow ones (verify)
        self.hybrid = any(lin.hybrid for L in self.layers for lin in (L.qkv, L.o, L.gate_up, L.down, self.output)
                          if lin is not None)
        self._pos = torch.zeros(1, dtype=torch.int32, device=self.device)           # graph inputs
        self._tokens = torch.zeros(MAX_W, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.cache: KVCache | None = None
        self.use_graphs = self.device.type == "cuda" if graphs is None else graphs
        # activations into the quantized GEMV: bf16 on the GPU (half the bytes it re-reads
        # per weight tile; 2.4x faster at W=1 than fp32, kernels/NOTES.md); the residual
        # stream stays fp32. The CPU interpreter (tests) keeps fp32.
        self.act_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # producers emit the int8 activations (no prepare launch) where the widths allow
        # programmatic dependent launch between the round's kernels (kernels/pdl.py)
        self.pdl = o.pdl and self.device.type == "cuda"
        self.capture_s = 0.0
        self.combine_in_norm, self.norm_router = o.combine_in_norm, o.norm_router
        self.early_kv = o.early_kv    # (the decode round qualifies: kernels/attention/decode.py)
        self.prefill_path = o.prefill_path
        self.prefill_chunk = prefill_chunk or DEFAULTS.engine.prefill_chunk
        # the dequantized-weight buffer of the prefill GEMMs (allocated on first use)
        sdt = self.act_dtype
        self.scratch = Scratch((o.prefill_scratch_mib << 20) // torch.empty(0, dtype=sdt).element_size(), sdt,
                               self.device, overlap=o.prefill_overlap, graphs=o.prefill_graphs)
        # the round of every width, made once (runtime/round.py): what each producer emits, which add
        self.round_plans = tuple(plan_round(self, W) for W in range(1, MAX_W + 1))

    def _start_cpu_tier(self, threads: int | None, progress) -> None:
        """CPU workers for the host tier, if every MoE layer fits the expert contract;
        else (or without a C compiler) the host tier stays read in place over PCIe."""
        from ..offload.native.workers import CpuExperts
        from ..offload.native.build import NativeBuildError
        from ..offload.native.probe import allowed_cpus
        views = [self.store.layer(i) for i in self.store.moe_layers.tolist()]
        if not all(contract_ok(v.host_gate_up, v.host_down) for v in views):
            if progress is not None:
                progress("CPU expert workers off: an expert format outside the contract (host tier over PCIe)", 0)
            return
        c = self.cfg
        mailbox = Mailbox.new(MAX_W, c.d_model, c.n_experts_used)
        try:
            self.cpu_experts = CpuExperts.from_store(self.store, mailbox, threads).start()
        except (NativeBuildError, OSError) as e:
            if progress is not None:
                progress(f"CPU expert workers off ({e}); host tier over PCIe", 0)
            return
        self.cpu_link = CpuLink(mailbox, self.device, DEFAULTS.offload.cpu_share)
        # the thread that launches rounds keeps to the cpus the workers left free
        self._launch_cpus = set(allowed_cpus()) - set(self.cpu_experts.cpus)
        for L in self.layers:
            if L.moe is not None:
                L.moe.link = self.cpu_link

    def _keep_launch_thread_apart(self) -> None:
        """Pin the calling (round-launching) thread, once, to the cpus the CPU workers do
        not use, so they never share a core with it (Linux; elsewhere a no-op)."""
        tid = threading.get_ident()
        if tid in self._pinned_threads or not self._launch_cpus or not hasattr(os, "sched_setaffinity"):
            return
        os.sched_setaffinity(0, self._launch_cpus)    # 0: this thread
        self._pinned_threads.add(tid)

    # -- the round ---------------------------------------------------------------------
    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.cfg
        # room for a full padded bucket past the last position: padding rows write there
        cache = KVCache(c.n_layers, c.n_kv_heads, (max_len or self.max_len) + MAX_W, c.head_dim,
                        dtype=torch.float16, device=self.device)
        cache.max_len -= MAX_W
        self.cache = cache
        self.graphs.clear()
        if self.use_graphs:
            self.capture()
        return cache

    def _rows(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [W] int64 (device), pos int32 [1] (device) -> (logits [W, V], hidden [W, D])."""
        return round_rows(self, tokens, pos, cache)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] int64 -> their embedding rows [T, D] float32 (the residual)."""
        if isinstance(self.embd, QuantWeight):
            return gather_rows(self.embd, tokens.to(self.device))   # (a no-op for the rounds' device ids)
        return dequantize(self.embd[tokens], self.embd_qtype, (tokens.shape[0], self.cfg.d_model))

    def _norm_router(self, L: GPULayer, W: int) -> bool:
        """Does layer L's FFN norm compute its router's logits at width W (engine.norm_router)?"""
        return self.round_plans[W - 1].layers[self.layers.index(L)].norm_router

    def capture(self) -> None:
        """One CUDA graph per width bucket, sharing one memory pool (replayed one at a time)."""
        t0 = time.perf_counter()
        cache = self.cache
        pool = torch.cuda.graph_pool_handle()
        self._pos.zero_()
        self._tokens.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in BUCKETS:                 # compile every kernel at every width first
                self._rows(self._tokens[:b], self._pos, cache)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with collector_paused(collect=True):      # no graph's reset mid-capture (runtime/capture.py)
            for b in reversed(BUCKETS):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    logits, hidden = self._rows(self._tokens[:b], self._pos, cache)
                self.graphs[b] = (g, logits, hidden)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0

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
        if pos > cache.length or pos + T > cache.max_len:
            raise ValueError(f"rows {pos}..{pos + T} do not fit a cache of {cache.length}/{cache.max_len}")
        tokens = tokens.to(self.device)
        if T > MAX_W and self.prefill_path == "dequant":
            return self._prefill(tokens, pos, cache, logits)
        outs = []
        for s in range(0, T, MAX_W):
            part = tokens[s:s + MAX_W]
            W = part.shape[0]
            self._pos.fill_(pos + s)
            if self.store is not None:
                self.store.before_round()
                if self.cpu_link is not None:
                    self.cpu_link.check()
                    if self.device.type == "cuda":   # (CPU tests: the runner's thread stays as it is)
                        self._keep_launch_thread_apart()
            if self.use_graphs and cache is self.cache:
                b = bucket_of(W)
                self._tokens[:W].copy_(part)
                if b > W:   # padding rows: any token; their K/V land past the real rows and are overwritten later
                    self._tokens[W:b].fill_(0)
                g, g_logits, g_hidden = self.graphs[b]
                g.replay()
                # the graph's outputs are static buffers: later chunks would overwrite them
                outs.append((g_logits[:W], g_hidden[:W]) if T <= MAX_W else (g_logits[:W].clone(), g_hidden[:W].clone()))
            else:
                outs.append(self._rows(part, self._pos, cache))
            if self.store is not None:
                self.store.after_launch(W)
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

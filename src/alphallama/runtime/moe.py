"""MoE: a layer's routed experts, resident or in an expert store's tiers (offload/store.py
says where each is read; offload/cpu_tier.py whether the CPU workers take the host ones).

gpt-oss's experts (Gating): a bias on the router's logits, the softmax over the k chosen
logits, a bias on every expert's gate, up and down, and the clamped swiglu_oai. The int8
kernels take them in decode (moe_i8, its MXFP4 experts included), the fp32 ones with
gemv "f32" and for prefill chunks (moe_f32, moe_gemm), and the expert contract too
(expert_q8.ExpertOps: its GPU kernels and the CPU workers), so with a store and the CPU
workers such a layer's host experts are computed where they sit, as any other's."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gguf.reader import TensorInfo
from ..kernels.formats.qweight import QuantWeight
from ..kernels.activations.silu import ACT_IDS
from ..kernels.gemv.qmatmul import qmatmul
from ..kernels.gemv.qmatvec_i8 import prepare_i8
from ..kernels.gemv.registry import ROWS_PER_THREAD
from ..kernels.moe.moe_f32 import MoEParts, moe_down, moe_gate_up
from ..kernels.moe.moe_i8 import moe_down_i8, moe_gate_up_i8, moe_i8_ok, moe_i8_order
from ..kernels.moe.expert_q8 import ExpertOps
from ..kernels.moe.moe_q8 import moe_q8
from ..kernels.moe.route import moe_route
from ..offload.cpu_tier import CpuLink
from ..offload.store import ExpertStore, Tiers, pack_experts
from .overrides import PRODUCT


@dataclass(frozen=True)
class Gating:
    """What a layer's routing and experts add to the base (softmax over all E, SiLU, no bias)."""
    act: str = "silu"                    # Variant.ffn_act (activations.silu.ACT_IDS)
    after: bool = False                  # softmax over the k chosen logits (Variant.moe_gating softmax_weight)
    biases: tuple | None = None          # (router [E], gate|up [E, 2F], down [E, D]) fp32 on the device

    def expert_ops(self) -> ExpertOps:
        """The experts' activation and biases as the expert contract takes them (gate|up's, down's)."""
        return ExpertOps(ACT_IDS[self.act], None if self.biases is None else tuple(self.biases[1:]))


class MoE:
    """Routed experts: router [E, D] (F32 in GGUF files, through qmatmul: row-invariant,
    unlike a cuBLAS GEMM whose kernel may change with W), gate|up fused along N per
    expert [E, 2F, D], down [E, D, F]. With an expert store (offload/store.py) the
    experts live there: the kernels take each from its VRAM slot or the host tier."""

    def __init__(self, router: TensorInfo, gate: TensorInfo, up: TensorInfo, down: TensorInfo, top_k: int,
                 norm: bool, device, store: ExpertStore | None = None, layer: int = 0, gemv: str = "f32",
                 prefill_fused: bool = PRODUCT.moe_prefill_fused, gating: Gating = Gating()):
        E = gate.shape[0]
        self.gating, self.act, self.ops = gating, ACT_IDS[gating.act], gating.expert_ops()
        self.router_bias, self.gate_up_bias, self.down_bias = gating.biases or (None, None, None)
        self.router = QuantWeight.from_raw(router.data, router.qtype, tuple(router.shape), device)
        # the router as a plain [E, D] float matrix, where it is one (F32/F16/BF16: its qs plane),
        # for the norm that computes the logits itself (engine.norm_router)
        qs = self.router.planes["qs"]
        self.router_rows = qs if qs.dtype.is_floating_point and tuple(qs.shape) == tuple(router.shape) else None
        self.store, self.layer = store, layer
        self.link: CpuLink | None = None   # set when the CPU workers serve the host tier
        if store is None:
            self.gate_up, self.down = pack_experts(gate, up, down, device)
            expert_bytes = self.gate_up.nbytes + self.down.nbytes
        else:
            v = store.layer(layer)
            expert_bytes = store.layer_bytes(layer)
        self.top_k, self.norm = top_k, norm
        self.prefill_fused = prefill_fused   # resident experts' prefill chunks through moe_gemm.moe_prefill
        # gemv "i8": the experts' GEMVs on int8 activations (kernels/moe/moe_i8.py; gpt-oss's
        # biases and swiglu_oai too), the layer's input in gate_up's lane order (its norm can
        # emit it: Linear.orders says the same)
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
        (>= 0) or the store's host tier (or its mapped file)."""
        if self.store is None:
            return self.gate_up.expert(e), self.down.expert(e)
        if slot >= 0:
            v = self.store.layer(self.layer)
            return v.bank_gate_up.expert(slot), v.bank_down.expert(slot)
        return self.store.host_expert(self.layer, e)

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
        t = self.tiers(h.shape[0])
        # with a store the ids also land in its record of the round (its admission policy)
        weights, experts = self.route(logits, t.routes)                         # [W, k] each
        if self.link is not None:   # the expert contract: the CPU takes host pairs, same bits as the GPU
            x8 = (q8 or {}).get(self._orders[0]) if self.i8 else None
            return moe_q8(h, weights, experts, t.gate_up, t.down, t.bank_gate_up, t.bank_down, t.table,
                          self.layer, self.link, ops=self.ops, q8=x8)
        act = moe_gate_up(h, t.gate_up, experts, act_dtype, ROWS_PER_THREAD, t.table, t.bank_gate_up,
                          self.gate_up_bias, self.act)                                                 # [W, k, F]
        return moe_down(act, t.down, experts, weights, ROWS_PER_THREAD, t.table, t.bank_down, self.down_bias)

    def route(self, logits: torch.Tensor, experts_out: torch.Tensor | None = None,
              pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [W, E] -> (weights, expert ids) [W, k]: the layer's gating."""
        return moe_route(logits, self.top_k, self.norm, experts_out=experts_out, pdl=pdl, bias=self.router_bias,
                         after=self.gating.after)

    def tiers(self, W: int) -> Tiers:
        """Where a round of W rows reads this layer's experts."""
        if self.store is None:
            return Tiers.resident(self.gate_up, self.down)
        return self.store.tiers(self.layer, W)

    def _experts_i8(self, h: torch.Tensor, logits: torch.Tensor, act_dtype: torch.dtype,
                    q8: dict | None, pdl: bool, combine: bool) -> "torch.Tensor | MoEParts":
        x8 = (q8 or {}).get(self._orders[0])
        t = self.tiers(h.shape[0])
        weights, experts = self.route(logits, t.routes, pdl)                   # [W, k] each
        x8 = x8 or prepare_i8(h, t.gate_up.expert(0), pdl)
        act = moe_gate_up_i8(x8, t.gate_up, experts, act_dtype, t.table, t.bank_gate_up, pdl,
                             bias=self.gate_up_bias, act=self.act)                                # [W, k, F]
        return moe_down_i8(act, t.down, experts, weights, t.table, t.bank_down, pdl, combine, self.down_bias)

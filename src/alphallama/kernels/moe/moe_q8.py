"""A MoE layer over an expert store under the expert contract (expert_q8.py): the launches of
expert_q8_gpu.py around moe_i8's kernels in their CONTRACT form (without CUDA or the
interpreter: the plain-torch reference).

Each (row, rank) pair is computed by the tier its expert is in: the VRAM bank, the
host tier read in place over PCIe, or the CPU workers (through `link`, a CpuLink of
offload/cpu_tier.py). Bits never depend on the tier: that is the contract. The bank and
PCIe pairs run the resident experts' kernels (moe_i8, CONTRACT: the contract's lanes and
adds, no fma), so a store with every expert in the bank costs what the resident layer
costs plus the post and the ordered combine. A layer's ExpertOps (expert_q8.py) give its
activation and its experts' biases (gpt-oss's).
"""
from __future__ import annotations

import torch
import triton

from .expert_q8 import ExpertOps, moe_q8 as moe_q8_ref, supports, supports_act
from .expert_q8_gpu import BD_COMBINE, NUM_WARPS, SPIN_LIMIT, q8_combine_kernel, q8_post_kernel, q8_quantize_kernel
from .moe_i8 import EXPERT_TYPES, moe_down_i8, moe_gate_up_i8
from ..backend import use_triton
from ..formats.qweight import QuantWeight
from ..gemv.qmatvec_i8 import prepare_i8
from .mailbox_layout import DONE, ERR, LAYER, REQ, ROWS

POST_CTL = dict(REQ=REQ, LAYER=LAYER, ROWS=ROWS)   # the post kernel's control words
TIER_BANK, TIER_HOST, TIER_CPU = 0, 1, 2


def contract_ok(gate_up: QuantWeight, down: QuantWeight, act: int = ExpertOps().act) -> bool:
    """Whether a layer's experts can run under the contract (formats, activation and shapes)."""
    D = down.N
    return (supports(gate_up) and supports(down) and gate_up.qtype in EXPERT_TYPES and down.qtype in EXPERT_TYPES
            and supports_act(act) and D % 32 == 0)


def moe_q8(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, host_gate_up: QuantWeight,
           host_down: QuantWeight, bank_gate_up: QuantWeight, bank_down: QuantWeight, table: torch.Tensor,
           layer: int, link=None, ops: ExpertOps = ExpertOps(),
           q8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """h [W, D] (bf16/fp32), weights/experts [W, k] (the router's) -> [W, D] float32.
    host_* [E, ...] are the layer's host tier, bank_* the shared bank, table [E] int32
    the slot of each expert (< 0: host). link: the CPU workers' mailbox, or None.
    ops: the experts' activation and biases (on h's device; the CPU workers hold theirs).
    q8: h's int8 activations in gate_up's lane order, if its norm made them (moe_i8_order)."""
    if not use_triton(h):
        # the plain-torch contract: a bank slot holds its expert's host bytes, so the
        # host tier alone gives the same bits; the CPU workers' protocol needs the kernels
        if link is not None:
            raise ValueError("the CPU expert tier needs the Triton kernels (CUDA or TRITON_INTERPRET=1)")
        return moe_q8_ref(h, host_gate_up, host_down, experts, weights, ops).to(h.device)
    W, D = h.shape
    k = experts.shape[1]
    dev = h.device
    h = h if h.stride(1) == 1 else h.contiguous()
    experts = experts.contiguous()
    post = link is not None
    mb = link.mailbox if post else None
    if post:   # the CPU workers' input: the contract's q8 of h in the mailbox
        q8_quantize_kernel[(W,)](h, mb.xq, mb.dx, mb.xs, h.stride(0), K=D, KP=triton.next_power_of_2(D),
                                 num_warps=NUM_WARPS, enable_fp_fusion=False)
    tier = torch.empty((W, k), dtype=torch.int32, device=dev)                   # [W, k]
    gpu = h.is_cuda
    if post:
        q8_post_kernel[(1,)](experts, table, tier, link.share, link.seq, mb.ids, mb.task, mb.ctl, W * k, layer, W,
                           BP=triton.next_power_of_2(mb.max_w * k), POST=True, GPU=gpu, num_warps=NUM_WARPS, **POST_CTL)
    else:
        q8_post_kernel[(1,)](experts, table, tier, table, table, tier, tier, tier, W * k, layer, W,
                           BP=triton.next_power_of_2(W * k), POST=False, GPU=gpu, num_warps=NUM_WARPS, **POST_CTL)
    # the bank's and the host tier's pairs on the resident kernels, the contract's arithmetic
    E = table.shape[0]
    if host_gate_up.shape[0] != E:   # a mapped layer: host_* are the bank's, never read (its other pairs: the CPU's)
        host_gate_up, host_down = (QuantWeight(w.qtype, (E, *w.shape[1:]), w.planes) for w in (host_gate_up, host_down))
    gu_bias, dn_bias = ops.biases or (None, None)       # (moe_i8 checks them against the experts' shapes)
    x8 = q8 if q8 is not None else prepare_i8(h, host_gate_up.expert(0))
    skip = (tier, TIER_CPU)
    act = moe_gate_up_i8(x8, host_gate_up, experts, torch.float32, table, bank_gate_up, bias=gu_bias, act=ops.act,
                         contract=True, skip=skip)                                                  # [W, k, F]
    y, _ = moe_down_i8(act, host_down, experts, weights, table, bank_down, combine=False, bias=dn_bias,
                       contract=True, skip=skip)                                                    # [W, k, D]
    if post and not gpu:
        link.wait_host()          # the interpreter cannot spin on memory another thread writes
    out = torch.empty((W, D), dtype=torch.float32, device=dev)
    ycpu = mb.y if post else y
    q8_combine_kernel[(W * triton.cdiv(D, BD_COMBINE),)](
        y, ycpu, weights.float().contiguous(), tier, out, link.seq if post else tier, mb.ctl if post else tier, D,
        TOP_K=k, BD=BD_COMBINE, WAIT=post and gpu, LIMIT=SPIN_LIMIT, DONE=DONE, ERR=ERR, num_warps=NUM_WARPS,
        enable_fp_fusion=False)
    return out


def cpu_limit(n_host: int, share: int) -> int:
    """Host pairs the CPU takes of n_host, share in 0..256 (the post kernel's rule)."""
    return (n_host * share + 128) >> 8


def tiers_torch(experts: torch.Tensor, table: torch.Tensor, share: int | None) -> torch.Tensor:
    """The post kernel's tier rule: [W, k] int32 (share None: no CPU workers; else 0..256).
    Host pairs (table -1) split by share; mapped ones (-2) are always the CPU's."""
    slot = table.long()[experts.long()]                                          # [W, k]
    host = slot == -1
    cpu = torch.zeros_like(host)
    if share is not None:
        rank = host.flatten().int().cumsum(0).reshape(host.shape) - 1
        cpu = (host & (rank < cpu_limit(int(host.sum()), share))) | (slot < -1)
    return torch.where(slot >= 0, TIER_BANK, torch.where(cpu, TIER_CPU, TIER_HOST)).to(torch.int32)


__all__ = ["moe_q8", "contract_ok", "tiers_torch"]

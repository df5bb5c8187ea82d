"""A MoE layer over an expert store under the expert contract (expert_q8.py): the
launches of expert_q8_gpu.py (without CUDA or the interpreter: the plain-torch reference).

Each (row, rank) pair is computed by the tier its expert is in: the VRAM bank, the
host tier read in place over PCIe, or the CPU workers (through `link`, a CpuLink of
offload/cpu_tier.py). Bits never depend on the tier: that is the contract. A layer's
ExpertOps (expert_q8.py) give its activation and its experts' biases (gpt-oss's).
"""
from __future__ import annotations

import torch
import triton

from .expert_q8 import ExpertOps, moe_q8 as moe_q8_ref, supports, supports_act
from .expert_q8_gpu import (BD_COMBINE, BN_DOWN, BN_GATE, NUM_WARPS, SPIN_LIMIT, layout_args, q8_combine_kernel,
                            q8_down_kernel, q8_gate_up_kernel, q8_post_kernel, q8_quantize_kernel)
from ..backend import use_triton
from ..formats.qweight import QuantWeight
from .mailbox_layout import DONE, ERR, LAYER, REQ, ROWS

POST_CTL = dict(REQ=REQ, LAYER=LAYER, ROWS=ROWS)   # the post kernel's control words
TIER_BANK, TIER_HOST, TIER_CPU = 0, 1, 2


def contract_ok(gate_up: QuantWeight, down: QuantWeight, act: int = ExpertOps().act) -> bool:
    """Whether a layer's experts can run under the contract (formats, activation and shapes)."""
    F, D = down.K, down.N
    return supports(gate_up) and supports(down) and supports_act(act) and D % 32 == 0 and F % BN_GATE == 0


def _bias_args(ops: ExpertOps, E: int, F: int, D: int) -> tuple[dict, dict]:
    """The gate|up and down kernels' bias keywords (none: their defaults)."""
    if ops.biases is None:
        return {}, {}
    gb, db = ops.biases
    if tuple(gb.shape) != (E, 2 * F) or tuple(db.shape) != (E, D) or {gb.dtype, db.dtype} != {torch.float32}:
        raise ValueError(f"the experts' biases {tuple(gb.shape)} {gb.dtype}, {tuple(db.shape)} {db.dtype} "
                         f"are not float32 [{E}, {2 * F}] and [{E}, {D}]")
    return {"ebias": gb.contiguous(), "HAS_EBIAS": True}, {"ebias": db.contiguous(), "HAS_EBIAS": True}


def moe_q8(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, host_gate_up: QuantWeight,
           host_down: QuantWeight, bank_gate_up: QuantWeight, bank_down: QuantWeight, table: torch.Tensor,
           layer: int, link=None, chunks: int | None = None, ops: ExpertOps = ExpertOps()) -> torch.Tensor:
    """h [W, D] (bf16/fp32), weights/experts [W, k] (the router's) -> [W, D] float32.
    host_* [E, ...] are the layer's host tier, bank_* the shared bank, table [E] int32
    the slot of each expert (< 0: host). link: the CPU workers' mailbox, or None.
    chunks: contract chunks per kernel step (a speed knob; no bit depends on it).
    ops: the experts' activation and biases (on h's device; the CPU workers hold theirs)."""
    if not use_triton(h):
        # the plain-torch contract: a bank slot holds its expert's host bytes, so the
        # host tier alone gives the same bits; the CPU workers' protocol needs the kernels
        if link is not None:
            raise ValueError("the CPU expert tier needs the Triton kernels (CUDA or TRITON_INTERPRET=1)")
        return moe_q8_ref(h, host_gate_up, host_down, experts, weights, ops).to(h.device)
    W, D = h.shape
    k = experts.shape[1]
    F = host_down.K
    dev = h.device
    gu_bias, dn_bias = _bias_args(ops, table.shape[0], F, D)   # E: the table's (a mapped layer's host_* is the bank)
    h = h if h.stride(1) == 1 else h.contiguous()
    experts = experts.contiguous()
    xq = torch.empty((W, D), dtype=torch.int8, device=dev)                      # [W, D]
    dx = torch.empty((W, D // 32), dtype=torch.float32, device=dev)
    xs = torch.empty((W, D // 16), dtype=torch.int32, device=dev)
    post = link is not None
    mb = link.mailbox if post else None
    q8_quantize_kernel[(W,)](h, xq, dx, xs, *((mb.xq, mb.dx, mb.xs) if post else (xq, dx, xs)), h.stride(0),
                           K=D, POST=post, KP=triton.next_power_of_2(D), num_warps=NUM_WARPS, enable_fp_fusion=False)
    tier = torch.empty((W, k), dtype=torch.int32, device=dev)                   # [W, k]
    gpu = h.is_cuda
    if post:
        q8_post_kernel[(1,)](experts, table, tier, link.share, link.seq, mb.ids, mb.task, mb.ctl, W * k, layer, W,
                           BP=triton.next_power_of_2(mb.max_w * k), POST=True, GPU=gpu, num_warps=NUM_WARPS, **POST_CTL)
    else:
        q8_post_kernel[(1,)](experts, table, tier, table, table, tier, tier, tier, W * k, layer, W,
                           BP=triton.next_power_of_2(W * k), POST=False, GPU=gpu, num_warps=NUM_WARPS, **POST_CTL)
    aq = torch.empty((W, k, F), dtype=torch.int8, device=dev)                   # [W, k, F]
    adx = torch.empty((W, k, F // 32), dtype=torch.float32, device=dev)
    axs = torch.empty((W, k, F // 16), dtype=torch.int32, device=dev)
    q8_gate_up_kernel[(W * k * (F // BN_GATE),)](
        xq, dx, xs, aq, adx, axs, experts, tier, table, *host_gate_up.plane_args(), *bank_gate_up.plane_args(),
        F, 1, TOP_K=k, BN=BN_GATE, **layout_args(host_gate_up, chunks), num_warps=NUM_WARPS, enable_fp_fusion=False,
        **gu_bias, **({"ACT": ops.act} if ops.act else {}))
    y = torch.empty((W, k, D), dtype=torch.float32, device=dev)                 # [W, k, D]
    q8_down_kernel[(W * k * triton.cdiv(D, BN_DOWN),)](
        aq, adx, axs, y, experts, tier, table, *host_down.plane_args(), *bank_down.plane_args(), D, 1,
        BN=BN_DOWN, **layout_args(host_down, chunks), num_warps=NUM_WARPS, enable_fp_fusion=False, **dn_bias)
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

"""How the distilled MTP head starts (`--init`).

`last-layer` (init_from_teacher): the block is a copy of the model's last layer (attention,
FFN, their norms), shared_head_norm is the model's output norm, enorm and hnorm are
ones, and eh_proj = [small random | s*I] with s the median RMS of h_p, so the block
starts by reading h_{p-1} at the scale the last layer sees (on Qwen2.5-Coder-0.5B it
then reproduces the model's own prediction at p-1: 75% top-1, KL 0.23, i.e. it starts
one position behind) and the token embedding enters through a small random map that
training grows. `--init random` keeps train/mtp.py's random init instead.
"""
from __future__ import annotations

import math

import torch

from .distill_teacher import Teacher
from .mtp import MTPHead


@torch.no_grad()
def init_from_teacher(head: MTPHead, teacher: Teacher, h_scale: float, seed: int) -> None:
    """See the module docstring. A MoE teacher's last layer has no dense FFN: the
    block's FFN then keeps its random init."""
    w, p = teacher.w, f"blk.{teacher.cfg.n_layers - 1}."
    copies = {head.attn_norm: "attn_norm.weight", head.ffn_norm: "ffn_norm.weight",
              head.wq.weight: "attn_q.weight", head.wk.weight: "attn_k.weight",
              head.wv.weight: "attn_v.weight", head.wo.weight: "attn_output.weight",
              head.gate.weight: "ffn_gate.weight", head.up.weight: "ffn_up.weight",
              head.down.weight: "ffn_down.weight"}
    if head.cfg.qkv_bias:
        copies |= {head.wq.bias: "attn_q.bias", head.wk.bias: "attn_k.bias", head.wv.bias: "attn_v.bias"}
    if head.cfg.qk_norm:
        copies |= {head.q_norm: "attn_q_norm.weight", head.k_norm: "attn_k_norm.weight"}
    for param, name in copies.items():
        if p + name in w and tuple(w[p + name].shape) == tuple(param.shape):
            param.copy_(w[p + name].float())
    head.shared_head_norm.copy_(teacher.output_norm.float())
    head.enorm.fill_(1.0)
    head.hnorm.fill_(1.0)
    Dm = head.cfg.d_model
    g = torch.Generator().manual_seed(seed)
    eh = torch.zeros(Dm, 2 * Dm)                                               # [D, 2D]: [embedding | hidden]
    eh[:, :Dm] = torch.randn(Dm, Dm, generator=g) * (0.1 * h_scale / math.sqrt(Dm))
    eh[:, Dm:] = torch.eye(Dm) * h_scale
    head.eh_proj.weight.copy_(eh)


@torch.no_grad()
def init_random(head: MTPHead, teacher: Teacher, h_scale: float, seed: int) -> None:
    """MTPHead's own random init; only shared_head_norm takes the model's output norm
    (the shared head was trained behind that norm)."""
    head.shared_head_norm.copy_(teacher.output_norm.float())


INITS = {"last-layer": init_from_teacher, "random": init_random}

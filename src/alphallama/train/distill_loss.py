"""Self-distillation loss of an MTP head against the frozen teacher, chunked over rows.

For every depth k and position p, the MTP entry (depth k, position p) predicts x_{p+1}
(docs/MTP.md), and its target is the teacher's own distribution at position p:
softmax(output(final_norm(h_p))), i.e. what the model itself will predict there. The
loss is KL(teacher_p || student_{k,p}) averaged over the valid entries of each depth.

A 150k-row output head makes [rows, V] logits the largest tensors of training
(8k rows x 151936 x 4 bytes = 5 GB per copy), so they are never kept: rows go through
the head in chunks, and the gradient with respect to the head's *input* is computed
on the spot (d KL / d logits = q - p; the head is frozen, so d/dx = (q - p) @ W) and
saved for the backward pass. Teacher logits are recomputed from the teacher's normed
hidden state per chunk and shared by every depth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KLStats:
    """Per-entry results (no gradient), [K, N] each."""
    kl: torch.Tensor            # KL(teacher || student), nats
    agree: torch.Tensor         # student's top-1 == teacher's top-1
    student_p: torch.Tensor     # the student's top-1 probability (the drafter's min-p test)
    teacher_top: torch.Tensor   # the teacher's top-1 token (int64)


class _ChunkedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t, weight, row_w, chunk):
        # x [K, N, D] student head inputs; t [N, D] teacher head inputs; weight [V, D];
        # row_w [K, N] loss weight of each entry (0: not a valid entry)
        K, N, _ = x.shape
        need_grad = ctx.needs_input_grad[0]
        ctx.x_dtype = x.dtype
        grad = torch.zeros(x.shape, dtype=torch.float32, device=x.device)      # [K, N, D]
        kl = torch.zeros(K, N, dtype=torch.float32, device=x.device)
        agree = torch.zeros(K, N, dtype=torch.bool, device=x.device)
        sp = torch.zeros(K, N, dtype=torch.float32, device=x.device)
        ttop = torch.zeros(N, dtype=torch.int64, device=x.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            lt = F.linear(t[s:e].to(weight.dtype), weight).float().log_softmax(-1)   # [n, V]
            p = lt.exp()                                                       # [n, V]
            neg_ent = (p * lt).sum(-1)                                         # [n]
            ttop[s:e] = lt.argmax(-1)
            del lt
            for k in range(K):
                ls = F.linear(x[k, s:e].to(weight.dtype), weight).float().log_softmax(-1)  # [n, V]
                kl[k, s:e] = neg_ent - (p * ls).sum(-1)
                top_ls, top = ls.max(-1)
                agree[k, s:e] = top == ttop[s:e]
                sp[k, s:e] = top_ls.exp()
                if need_grad:
                    g = ls.exp_().sub_(p).mul_(row_w[k, s:e, None])            # [n, V] = w (q - p)
                    grad[k, s:e] = (g.to(weight.dtype) @ weight).float()       # [n, D]
                    del g
                del ls
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(kl, agree, sp, ttop)
        return (kl * row_w).sum(), kl, agree, sp, ttop

    @staticmethod
    def backward(ctx, g_loss, *_):
        (grad,) = ctx.saved_tensors
        return (grad * g_loss).to(ctx.x_dtype), None, None, None, None


def depth_weights(valid: torch.Tensor, depth_weight: torch.Tensor | None = None) -> torch.Tensor:
    """valid [K, N] bool -> row weights [K, N]: each depth's valid entries average to
    one term, scaled by depth_weight [K] (default 1 each)."""
    w = valid.float() / valid.sum(-1, keepdim=True).clamp(min=1)               # [K, N]
    if depth_weight is not None:
        w = w * depth_weight[:, None].to(w)
    return w


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor,
               valid: torch.Tensor, depth_weight: torch.Tensor | None = None,
               chunk: int = 1024) -> tuple[torch.Tensor, KLStats]:
    """The distillation loss and per-entry statistics.

    student [K, N, D]: head inputs (after shared_head_norm) of the depth-k entry at each
    of N positions; teacher [N, D]: the teacher's head inputs (after its final norm) at
    the same positions, i.e. the teacher's distribution at position p is the target of
    every depth's entry at p. weight [V, D]: the shared output head (frozen).
    valid [K, N]: entries that exist (a depth-k entry needs p >= k in its sequence).
    Returns (scalar loss = sum over depths of the mean KL, KLStats)."""
    if student.dim() != 3 or teacher.shape != student.shape[1:] or valid.shape != student.shape[:2]:
        raise ValueError(f"shapes: student {tuple(student.shape)} must be [K, N, D], teacher "
                         f"{tuple(teacher.shape)} [N, D], valid {tuple(valid.shape)} [K, N]")
    row_w = depth_weights(valid, depth_weight)
    loss, kl, agree, sp, ttop = _ChunkedKL.apply(student, teacher.detach(), weight.detach(), row_w, chunk)
    return loss, KLStats(kl, agree, sp, ttop)

"""Cross-entropy of a linear head without the [N, V] float32 logits of the plain form.

The embedded model's step computes four full-vocabulary cross-entropies (the model's
and the MTP head's three depths) over B*T = 65,536 rows of V = 12,288 logits: the plain
`F.cross_entropy(F.linear(h, W).float(), t)` writes bf16 logits, a float32 copy and the
float32 log-softmax (kept for backward), then a dense float32 gradient and its bf16 cast:
~42 bytes of traffic a logit. `linear_ce` takes the rows in chunks, computes each chunk's
log-softmax in float32 from the bf16 logits, and makes that chunk's gradients (w.r.t. the
rows and the head) at once, so backward only scales two small saved tensors: ~34 bytes a
logit (bench/train_step_cost.py counts them), and one chunk of logits held at a time
instead of four [N, V] float32 log-softmaxes kept for backward (~13 GB at the real shape).

    loss = linear_ce(h, W, t, chunk=8192)   # == F.cross_entropy(F.linear(h, W).float(), t)
    kl = linear_kl(h, W, ha, Wa, chunk)      # mean KL(softmax(ha @ Wa.T) || softmax(h @ W.T))
    rows = subset_rows(n, frac, generator)  # a uniform random subset of round(frac * n) rows

Under autocast the matrix products run in the autocast dtype (as F.linear's would), the
softmax in float32; without autocast everything runs in h's dtype. The mean of the loss
over a uniform random subset of rows is an unbiased estimate of the mean over all rows
(and so is its gradient): the MTP losses use it to skip most of their logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _mm_dtype(h: torch.Tensor) -> torch.dtype:
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


class _LinearCE(torch.autograd.Function):
    """Sum over rows of CE(h @ W.T, target), gradients made chunk by chunk in forward. The
    target is a token t [N], or (t None) the softmax q of the frozen ha @ Wa.T: then the sum
    is of KL(q || softmax(h @ W.T)), whose gradient w.r.t. the logits is softmax - q, as a
    token's is softmax - onehot."""

    @staticmethod
    def forward(ctx, h, w, t, ha, wa, chunk: int, dt: torch.dtype, grads: bool):
        n = h.shape[0]
        want_h, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        acc = torch.promote_types(dt, torch.float32)                           # softmax and sums
        wd = w.to(dt)                                                          # [V, D]
        wad = None if t is not None else wa.to(dt)                             # [V, Da]
        total = torch.zeros((), device=h.device, dtype=acc)
        gh = torch.empty_like(h) if want_h else None                           # [N, D]
        gw = torch.zeros(w.shape, device=w.device, dtype=acc) if want_w else None   # [V, D]
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, n, chunk):
                hc = h[lo:lo + chunk].to(dt)                                   # [c, D]
                logp = F.log_softmax(hc @ wd.T, dim=-1, dtype=acc)   # [c, V]
                if t is not None:
                    tc = t[lo:lo + chunk, None]                                # [c, 1]
                    total -= logp.gather(1, tc).sum()
                else:
                    logq = F.log_softmax(ha[lo:lo + chunk].to(dt) @ wad.T, dim=-1, dtype=acc)   # [c, V]
                    q = logq.exp()
                    total += (q * (logq - logp)).sum()
                if not (want_h or want_w):
                    continue
                g = logp.exp_()                                                # softmax
                if t is not None:
                    g.scatter_add_(1, tc, torch.full(tc.shape, -1.0, device=g.device, dtype=g.dtype))
                else:
                    g -= q
                g = g.to(dt)                                                   # dloss/dlogits
                if want_h:
                    gh[lo:lo + chunk] = (g @ wd).to(h.dtype)
                if want_w:
                    gw += (g.T @ hc).to(acc)
        ctx.save_for_backward(gh if want_h else None, gw if want_w else None)
        ctx.w_dtype = w.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * grad.to(gh.dtype),
                None if gw is None else (gw * grad).to(ctx.w_dtype), None, None, None, None, None, None)


def linear_ce(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean cross-entropy of the logits h @ w.T ([N, D] @ [D, V]) against targets t [N].
    chunk 0: the plain form (one [N, V] float32 tensor); else rows `chunk` at a time."""
    if chunk <= 0:
        return F.cross_entropy(F.linear(h, w).float(), t)
    if h.shape[0] == 0:
        raise ValueError("no rows to score")
    return _LinearCE.apply(h, w, t, None, None, chunk, _mm_dtype(h), torch.is_grad_enabled()) / h.shape[0]


def linear_kl(h: torch.Tensor, w: torch.Tensor, ha: torch.Tensor, wa: torch.Tensor, chunk: int = 0) -> torch.Tensor:
    """Mean over rows of KL(softmax(ha @ wa.T) || softmax(h @ w.T)): the distance of a model
    ([N, D] rows, head w [V, D]) from a frozen one (ha, wa: no gradient reaches them), rows
    `chunk` at a time (0: all at once)."""
    if h.shape[0] == 0:
        raise ValueError("no rows to score")
    ha, wa = ha.detach(), wa.detach()
    return _LinearCE.apply(h, w, None, ha, wa, chunk if chunk > 0 else h.shape[0], _mm_dtype(h),
                           torch.is_grad_enabled()) / h.shape[0]


def subset_rows(n: int, frac: float, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu") -> torch.Tensor | None:
    """max(1, round(frac * n)) distinct row indices drawn uniformly (sorted), or None for
    all rows (frac >= 1). Drawn on the CPU from `generator`, then moved to `device`."""
    if frac >= 1.0:
        return None
    if frac <= 0.0:
        raise ValueError(f"a share of rows must be in (0, 1], not {frac}")
    m = max(1, round(frac * n))
    return torch.randperm(n, generator=generator)[:m].sort().values.to(device, non_blocking=True)

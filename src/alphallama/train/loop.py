"""The time-budgeted training loop: the main model and its MTP head trained jointly
(the head reads the main model's hidden state detached, so the MTP loss shapes the head,
the shared embedding and output head, but not the trunk), bf16 autocast on CUDA,
AdamW with warmup and a cosine decay over the time budget, checkpoints to a work folder
so that a later call resumes, and the loss curves.

    state = train(model, head, train_tokens, val_tokens, hp, device, ckpt_path, deadline)
"""
from __future__ import annotations

import copy
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config import DEFAULTS
from .ce import linear_ce, linear_kl
from .data import get_batch, val_batch
from .model import MoEModel, autocast
from .mtp import MTPHead, mtp_losses
from .unlikely import LoopTerm, Unlikely

D = DEFAULTS.train


@dataclass
class Hyper:
    batch_size: int
    ctx_len: int
    lr: float
    warmup_steps: int
    time_budget_s: float
    mtp_depths: int
    mtp_weight: float
    aux_weight: float
    checkpoint_every_s: float = D.checkpoint_every_s
    log_every: int = D.log_every
    val_every_s: float = D.val_every_s
    val_windows: int = D.val_windows
    seed: int = D.seed
    weight_decay: float = D.weight_decay
    ce_chunk: int = D.ce_chunk        # rows per chunk of the cross-entropies (0: the plain [B,T,V] form)
    mtp_frac: float = D.mtp_frac      # share of positions the MTP losses score each step
    max_steps: int | None = None     # tests: stop after this many steps whatever the time
    unlikely: Unlikely = field(default_factory=Unlikely)   # the loops' unlikelihood term (weight 0: off)
    anchor: float = 0.0              # + anchor x KL(start model || model) on the windows (0: off)


@dataclass
class State:
    step: int = 0
    trained_s: float = 0.0
    tokens: int = 0
    curves: dict = field(default_factory=lambda: {"train": [], "val": []})


def lr_at(hp: Hyper, st: State, budget_s: float) -> float:
    """Linear warmup over steps, then cosine to 10% over the fraction of the budget used."""
    if st.step < hp.warmup_steps:
        return hp.lr * (st.step + 1) / hp.warmup_steps
    frac = min(1.0, st.trained_s / budget_s)
    return hp.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class Losses(NamedTuple):
    main: torch.Tensor           # the model's cross-entropy
    mtp: list                    # the MTP head's, one a depth
    aux: torch.Tensor            # the router's balance loss
    acc: list                    # MTP top-1 accuracy a depth (with_acc), else []
    kl: torch.Tensor | None      # KL(anchor || model) a position (anchor given), else None


def losses(model: MoEModel, head: MTPHead, x: torch.Tensor, depths: int, device: str, with_acc: bool = False,
           chunk: int = 0, mtp_frac: float = 1.0, generator: torch.Generator | None = None,
           anchor: MoEModel | None = None) -> Losses:
    """The losses on windows x [B, T+1]. chunk > 0: the cross-entropies in row chunks
    (ce.linear_ce, no [B, T, V] float32 logits); mtp_frac < 1: each MTP depth scored on a
    random share of its positions drawn from `generator` (an unbiased estimate of its mean);
    anchor: a frozen model whose next-token distribution the model is kept near."""
    inp, tgt = x[:, :-1], x[:, 1:]                                            # [B, T]
    kl = None
    with autocast(device):
        hidden, aux = model(inp)                                              # [B, T, D]
        rows = model.normed(hidden).flatten(0, 1)                             # [B*T, D]
        main = linear_ce(rows, model.embed, tgt.flatten(), chunk)
        if anchor is not None:
            with torch.no_grad():
                ha = anchor.normed(anchor(inp)[0]).flatten(0, 1)              # [B*T, D]
            kl = linear_kl(rows, model.embed, ha, anchor.embed, chunk)
        states = head(hidden.detach(), inp, model.embed, depths)
        mtp = mtp_losses(states, model.embed, inp, chunk=chunk, frac=mtp_frac, generator=generator)
    if not with_acc:
        return Losses(main, mtp, aux, [], kl)
    with torch.no_grad():
        T = inp.shape[1]
        acc = [(F.linear(s[:, k:T - 1].float(), model.embed).argmax(-1) == inp[:, k + 1:]).float().mean()
               for k, s in enumerate(states, start=1)]
    return Losses(main, mtp, aux, acc, kl)


def frozen_copy(model: MoEModel) -> MoEModel:
    """The start model as the anchor: its own weights, no gradient, eval mode."""
    anchor = copy.deepcopy(model).eval()
    for p in anchor.parameters():
        p.requires_grad_(False)
    return anchor


def _optimizer(model, head, hp: Hyper, device: str) -> torch.optim.Optimizer:
    params = [p for m in (model, head) for p in m.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    kw = {"fused": True} if device.startswith("cuda") else {}
    return torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95), **kw)


def save(path: Path, model, head, opt, st: State) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"model": model.state_dict(), "head": head.state_dict(), "opt": opt.state_dict(),
                "state": asdict(st)}, tmp)
    tmp.replace(path)


def load(path: Path, model, head, opt) -> State | None:
    """Resume from a checkpoint of the same shapes; None if there is none (or it does not
    fit). weights_only=True: a checkpoint holds tensors and plain values only, so a file
    that would unpickle anything else is refused (None), never executed."""
    if not path.exists():
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["opt"])
        return State(**ck["state"])
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, KeyError, TypeError):
        return None


@torch.no_grad()
def evaluate(model, head, val: torch.Tensor, hp: Hyper, device: str) -> dict:
    model.eval()
    head.eval()
    main, mtp, _, acc, _ = losses(model, head, val, hp.mtp_depths, device, with_acc=True, chunk=hp.ce_chunk)
    model.train()
    head.train()
    return {"loss": main.item(), "mtp": [m.item() for m in mtp], "mtp_top1": [a.item() for a in acc]}


def schedule_budget(hp: Hyper, st: State, deadline: float | None, now: float, continue_later: bool) -> float:
    """The trained seconds the learning rate's schedule spans: it ends where training will
    end, at the time budget, or earlier at this call's deadline (less a little for evaluations
    and checkpoints, which are not trained time) unless a later call goes on from here."""
    if deadline is None or continue_later:
        return hp.time_budget_s
    return min(hp.time_budget_s, st.trained_s + 0.95 * max(1.0, deadline - now))


def train(model: MoEModel, head: MTPHead, train_tokens: torch.Tensor, val_tokens: torch.Tensor,
          hp: Hyper, device: str, ckpt: Path | None, deadline: float | None = None,
          log=print, continue_later: bool = False, eot: int | None = None,
          stop_ids: tuple[int, ...] = ()) -> State:
    """Train until the state's trained seconds reach hp.time_budget_s, the wall clock
    reaches `deadline` (time.time()), or hp.max_steps; checkpoint along the way.
    continue_later: a later call resumes from the checkpoint, so the schedule spans the
    whole time budget and the deadline only stops this call. hp.unlikely.weight > 0 adds
    the unlikelihood of the model's own loops (unlikely.py; eot separates the documents,
    stop_ids end a rollout's text); hp.anchor > 0 adds the KL from the model as it comes in
    (before a checkpoint is resumed: the anchor is the run's start, not the call's)."""
    model.to(device).train()
    head.to(device).train()
    anchor = frozen_copy(model) if hp.anchor > 0 else None
    opt = _optimizer(model, head, hp, device)
    st = (load(ckpt, model, head, opt) if ckpt else None) or State()
    if st.step:
        log(f"resumed at step {st.step} ({st.trained_s:.0f} s, {st.tokens / 1e6:.1f}M tokens)")
    val = val_batch(val_tokens, hp.val_windows, hp.ctx_len, device)
    budget = schedule_budget(hp, st, deadline, time.time(), continue_later)
    last_ck = last_val = time.time()
    t_log, tok_log = time.time(), st.tokens
    term = None
    if hp.unlikely.weight > 0:
        if eot is None:
            raise ValueError("the unlikelihood term needs the documents' separator (eot)")
        term = LoopTerm(hp.unlikely, train_tokens, eot, stop_ids, hp.seed)
    ul, ul_share = None, None

    def done() -> bool:
        return (st.trained_s >= hp.time_budget_s or (deadline is not None and time.time() >= deadline)
                or (hp.max_steps is not None and st.step >= hp.max_steps))

    while not done():
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr = lr_at(hp, st, budget)
        x = get_batch(train_tokens, hp.batch_size, hp.ctx_len, hp.seed, st.step, device)
        g = torch.Generator().manual_seed(hp.seed * 1_000_003 + st.step + 1)   # the MTP rows of this step
        main, mtp, aux, _, kl = losses(model, head, x, hp.mtp_depths, device, chunk=hp.ce_chunk,
                                       mtp_frac=hp.mtp_frac, generator=g, anchor=anchor)
        loss = main + hp.mtp_weight * sum(mtp) / len(mtp) + hp.aux_weight * aux
        if kl is not None:
            loss = loss + hp.anchor * kl
        if term is not None and term.due(st.step):
            ul, ul_share = term(model, st.step, device)
            loss = loss + hp.unlikely.weight * ul
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_([p for m in (model, head) for p in m.parameters()], 1.0)
        opt.step()
        st.step += 1
        st.tokens += x.shape[0] * hp.ctx_len
        if st.step % hp.log_every == 0 or st.step == 1:
            row = {"step": st.step, "s": round(st.trained_s, 1), "tokens": st.tokens, "lr": lr,
                   "loss": main.item(), "mtp": [m.item() for m in mtp], "aux": aux.item(),
                   "gnorm": gnorm.item(), "tok_s": (st.tokens - tok_log) / max(time.time() - t_log, 1e-9)}
            if ul is not None:   # the last term's: its loss and the share of rollout tokens in a loop
                row |= {"ul": ul.item(), "loop_share": ul_share}
            if kl is not None:
                row["kl"] = kl.item()
            t_log, tok_log = time.time(), st.tokens
            st.curves["train"].append(row)
            log(f"step {st.step:5d} {st.trained_s:6.0f}s lr {lr:.2e} loss {row['loss']:.3f} mtp "
                + " ".join(f"{m:.3f}" for m in row["mtp"]) + f" aux {row['aux']:.3f} {row['tok_s'] / 1e3:.0f}k tok/s"
                + (f" ul {row['ul']:.4f} loops {row['loop_share']:.3f}" if "ul" in row else "")
                + (f" kl {row['kl']:.4f}" if "kl" in row else ""))
        st.trained_s += time.time() - t0
        if time.time() - last_val >= hp.val_every_s:
            st.curves["val"].append({"step": st.step, "s": round(st.trained_s, 1), "tokens": st.tokens,
                                     **evaluate(model, head, val, hp, device)})
            last_val = time.time()
        if ckpt and time.time() - last_ck >= hp.checkpoint_every_s:
            save(ckpt, model, head, opt, st)
            last_ck = time.time()
    st.curves["val"].append({"step": st.step, "s": round(st.trained_s, 1), "tokens": st.tokens,
                             **evaluate(model, head, val, hp, device)})
    if ckpt:
        save(ckpt, model, head, opt, st)
    return st

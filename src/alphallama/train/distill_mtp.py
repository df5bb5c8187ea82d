"""An MTP sidecar for a frozen GGUF model, by self-distillation on the GPU.

    python -m alphallama.train.distill_mtp -m MODEL.gguf --out DIR [--time-budget-s 240]

The teacher (the model, frozen, bf16) reads Python source and chat requests that it
answers itself (greedy); the MTP head (train/mtp.py, docs/MTP.md semantics, depths
1..K with hidden states fed back) learns, at every position p and depth k, the
teacher's own distribution at p (distill_loss.py). Writes to --out: the sidecar
`<stem>.mtp.gguf` split into parts with a .sha256 list (join with
`python -m alphallama.train join`), the training curves and held-out
evaluation as JSON; bench/gpu_distill_mtp.sh runs it on the device.

Phases (one process; every phase logs its time): corpus (train/corpus.py, files held
out by hash) and chat requests tokenized in worker processes; the teacher loaded; one
smoke training step; the teacher answers the requests for --gen-budget-s (held-out
ones first: the evaluation set); a held-out evaluation; training for --time-budget-s
(AdamW, bf16 autocast, warmup then cosine over the time budget, an evaluation every
--eval-every-s); the sidecar written and split; the final evaluation; the JSON. The
whole run ends within --deadline-s (training is shortened if the phases before it
ran long), so a device call with a 600 s limit always brings the files back.

Init: distill_init.py (by default the block starts as a copy of the model's last layer).

Evaluation (distill_eval.py) is in the drafter's terms: on the teacher's own greedy
answers to held-out requests, top-1 agreement per depth is exact-mode acceptance, so
chain survival, conditional hit rates and tokens per round follow (the code set, made
of corpus text, is the same arithmetic on text the model did not write).
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import random
import shlex
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from ..bench.hostinfo import host_state
from ..config import DEFAULTS
from ..private_dir import private_dir
from . import corpus
from .distill_data import ChatEncoder, RowSampler, encode_parallel, pack, tokenize_texts
from .distill_eval import evaluate, pack_answers, summary
from .distill_generate import generate_all
from .distill_init import INITS
from .distill_loss import distill_kl
from .distill_requests import make_requests
from .distill_teacher import Teacher
from .mtp import MTPConfig, MTPHead, write_sidecar
from .parts import split_file

D = DEFAULTS.distill


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def valid_mask(K: int, B: int, T: int, device) -> torch.Tensor:
    """[K, B*T]: the depth-k entry at p exists for p >= k (its chain reaches h_{p-k})."""
    pos = torch.arange(T, device=device)
    return torch.stack([(pos >= k).expand(B, T).reshape(-1) for k in range(1, K + 1)])


def step_loss(teacher: Teacher, states: list[torch.Tensor], h: torch.Tensor, chunk: int):
    """The loss of one batch: states[k-1][:, p] (the depth-k entry at p, predicting
    x_{p+1}) against the teacher's distribution at the same p (its own prediction of
    x_{p+1}, from h [B, T, D]). Returns (loss, KLStats, valid [K, B*T])."""
    K, (B, T, _) = len(states), h.shape
    student = torch.stack(states).reshape(K, B * T, -1)                        # [K, B*T, D]
    valid = valid_mask(K, B, T, h.device)
    loss, st = distill_kl(student, teacher.normed(h).reshape(B * T, -1), teacher.output, valid, chunk=chunk)
    return loss, st, valid


def prepare_data(args, enc: ChatEncoder) -> dict:
    """The CPU half of the data (worker processes; run before CUDA is initialised, so
    the forked tokenizer workers never inherit a CUDA context): the corpus, its tokens,
    and the chat requests with their prompts encoded."""
    roots = ([(f"root{i}", Path(r)) for i, r in enumerate(args.corpus_root)] if args.corpus_root
             else corpus.default_roots())
    files = corpus.collect(roots, max_bytes=args.corpus_mb << 20, held_out_fraction=args.held_out_frac)
    train = [f.text for f in files if not f.held_out]
    held = [f.text for f in files if f.held_out]
    random.Random(args.seed).shuffle(train)
    log(f"corpus: {len(files)} files ({len(held)} held out), {sum(f.size for f in files) >> 20} MiB")
    code = tokenize_texts(args.model, train, args.code_tokens, args.workers)
    code_eval = tokenize_texts(args.model, held, args.eval_code_rows * args.seq_len, args.workers)
    answered_only = args.gen_budget_s <= 0
    reqs = [(False, r) for r in make_requests(train, args.requests, args.seed, answered_only, args.workers)]
    reqs += [(True, r) for r in make_requests(held, args.eval_requests, args.seed + 1, answered_only,
                                              args.workers)]
    encoded = encode_parallel(args.model, [("chat", r.user, r.answer) for _, r in reqs], args.workers)
    chats = [(is_eval, p, a) for (is_eval, _), (p, a) in zip(reqs, encoded) if len(p) <= args.max_prompt]
    log(f"tokens: {sum(map(len, code))} corpus, {sum(map(len, code_eval))} held-out corpus, "
        f"{len(chats)} chat requests")
    return {"files": len(files), "held": len(held), "code": code, "code_eval": code_eval, "chats": chats,
            "kinds": {k: sum(r.kind == k for _, r in reqs) for k in sorted({r.kind for _, r in reqs})}}


def finish_data(args, teacher: Teacher, enc: ChatEncoder, prep: dict,
                code_rows: torch.Tensor) -> tuple[dict, dict, dict]:
    """The teacher answers the requests (held-out ones first, so the evaluation set is
    complete whatever the deadline); everything is packed into rows. Returns
    (training sources, evaluation sets, data statistics)."""
    T, sep, chats = args.seq_len, enc.sep_id, prep["chats"]
    if args.gen_budget_s > 0:
        deadline = time.monotonic() + args.gen_budget_s
        stops = sorted(teacher_stops(enc))
        answers: list = [None] * len(chats)
        for want_eval in (True, False):
            idx = [i for i, c in enumerate(chats) if c[0] == want_eval]
            got = guarded("generation", lambda: generate_all(  # noqa: B023 - called at once
                teacher, [chats[i][1] for i in idx], args.max_new, stops, deadline, seed=args.seed, log=log),
                [None] * len(idx))
            for i, a in zip(idx, got):
                answers[i] = a
    else:
        answers = [a or None for _, _, a in chats]
    eval_chats = [(p, a) for (e, p, _), a in zip(chats, answers) if e and a]
    train_chats = [(p, a) for (e, p, _), a in zip(chats, answers) if not e and a]
    sources = {"code": code_rows}
    if train_chats:
        sources["chat"] = pack([p + a for p, a in train_chats], T, sep, args.seed)
    evals = {}
    if sum(map(len, prep["code_eval"])) >= T:
        evals["code"] = (pack(prep["code_eval"], T, sep, args.seed)[:args.eval_code_rows], None)
    if eval_chats:
        evals["chat"] = pack_answers(eval_chats, sep)
    stats = {"corpus_files": prep["files"], "held_out_files": prep["held"],
             "code_tokens": sum(map(len, prep["code"])), "chat_sequences": len(train_chats),
             "chat_tokens": sum(len(p) + len(a) for p, a in train_chats),
             "generated_tokens": sum(len(a) for a in answers if a) if args.gen_budget_s > 0 else 0,
             "eval_chat_sequences": len(eval_chats), "request_kinds": prep["kinds"]}
    return sources, evals, stats


def teacher_stops(enc: ChatEncoder) -> set[int]:
    return set(enc.tok.stop_ids) | {enc.end_id}


def lr_at(args, step: int, frac: float) -> float:
    """Linear warmup over steps, then cosine over the time budget to min_lr_frac."""
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return args.lr * warm * cos


def train(args, teacher: Teacher, head: MTPHead, sampler: RowSampler, evals: dict,
          stop_at: float = math.inf) -> list[dict]:
    """Steps until the time budget (or the absolute time stop_at); every eval_every_s a
    held-out evaluation whose time does not count against the budget."""
    K, dev = args.depths, teacher.device
    decay = [p for p in head.parameters() if p.dim() == 2]
    rest = [p for p in head.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            **({"fused": True} if dev.type == "cuda" else {}))
    curve, step, tokens = [], 0, 0
    acc = torch.zeros(3, K, device=dev)                                        # kl, agree, count
    t0 = last_eval = time.monotonic()

    def emit(lr: float, gnorm: torch.Tensor) -> None:
        a = acc.cpu()
        row = {"step": step, "time_s": round(time.monotonic() - t0, 2), "tokens": tokens, "lr": lr,
               "grad_norm": float(gnorm), "kl": (a[0] / a[2]).tolist(), "top1_agree": (a[1] / a[2]).tolist(),
               "tok_s": tokens / max(1e-9, time.monotonic() - t0), "epochs": dict(sampler.epochs)}
        curve.append(row)
        acc.zero_()
        log(f"step {step:5d}  {row['time_s']:6.1f}s  lr {lr:.2e}  " + "  ".join(
            f"d{k + 1} kl {row['kl'][k]:.3f} agree {row['top1_agree'][k]:.3f}" for k in range(K))
            + f"  {row['tok_s']:.0f} tok/s")

    while True:
        if evals and args.eval_every_s > 0 and time.monotonic() - last_eval >= args.eval_every_s:
            t_ev = time.monotonic()
            ev = guarded("evaluation", lambda: summary(run_evals(args, teacher, head, evals)), None)
            if ev is None:
                evals = {}   # it failed once: train on without it
            else:
                curve.append({"step": step, "tokens": tokens, "eval": ev})
            last_eval = time.monotonic()
            t0 += last_eval - t_ev
        elapsed = time.monotonic() - t0
        if (elapsed >= args.time_budget_s or time.monotonic() >= stop_at
                or (args.max_steps and step >= args.max_steps)):
            break
        lr = lr_at(args, step, elapsed / args.time_budget_s)
        for g in opt.param_groups:
            g["lr"] = lr
        toks = sampler.batch(args.batch_size).to(dev, non_blocking=True)       # [B, T]
        B, T = toks.shape
        h = teacher.forward(toks)                                              # [B, T, D] float32
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            states = head(h, toks, teacher.embedding, depths=K)
        loss, st, valid = step_loss(teacher, states, h, args.loss_chunk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
        opt.step()
        acc += torch.stack([(st.kl * valid).sum(-1), (st.agree & valid).sum(-1), valid.sum(-1)])
        step += 1
        tokens += B * T
        if step % args.log_every == 0 or step == 1:
            emit(lr, gnorm)
    if step % args.log_every and step > 1:
        emit(lr, gnorm)
    return curve


def run_evals(args, teacher: Teacher, head: MTPHead, evals: dict) -> dict:
    head.eval()
    out = {}
    for name, data in evals.items():
        if data is None:
            continue
        rows, counted = data
        out[name] = evaluate(head, teacher, rows, args.depths, args.eval_batch, counted, args.min_p)
        d = out[name]["depths"]
        log(f"eval {name}: " + "  ".join(f"d{x['depth']} agree {x['top1_agree']:.3f} hit {x['conditional_hit']:.3f}"
                                         for x in d)
            + f"  tokens/round {out[name]['tokens_per_round_ungated']:.2f} (gated {out[name]['gated_tokens_per_round']:.2f})"
            + f"  teacher top-1 = next token {out[name]['teacher_top1_is_next_token']:.3f}")
    head.train()
    return out


def smoke_step(args, teacher: Teacher, head: MTPHead, toks: torch.Tensor) -> None:
    """One forward and backward (gradients discarded) before the long phases, so a
    broken training step fails in seconds, not after the generation."""
    t = time.monotonic()
    h = teacher.forward(toks)                                                  # [2, T, D]
    with torch.autocast(teacher.device.type, dtype=torch.bfloat16, enabled=teacher.device.type == "cuda"):
        states = head(h, toks, teacher.embedding, depths=args.depths)
    loss, _, _ = step_loss(teacher, states, h, args.loss_chunk)
    loss.backward()
    head.zero_grad(set_to_none=True)
    log(f"smoke step: loss {float(loss.detach()):.3f} in {time.monotonic() - t:.1f}s")


def guarded(what: str, fn, fallback):
    """fn(), or fallback after logging the traceback: a failing evaluation or generation
    must not cost the run (the trained head is the product)."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - any failure of an optional phase
        log(f"{what} failed, continuing without it:\n{traceback.format_exc()}")
        return fallback


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m alphallama.train.distill_mtp", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="the frozen model (GGUF)")
    ap.add_argument("--out", required=True, help="folder for the sidecar parts, curves JSON")
    ap.add_argument("--sidecar-name", default=None, help="default: <model stem>.mtp.gguf")
    ap.add_argument("--work-dir", default=D.work_dir, help="where the whole sidecar is written")
    ap.add_argument("--corpus-root", action="append", default=[],
                    help="a folder of Python files (repeatable; default: this interpreter's stdlib and site-packages)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="tokenizer processes")
    for name in ("time_budget_s", "gen_budget_s", "lr", "min_lr_frac", "weight_decay", "grad_clip",
                 "chat_share", "held_out_frac", "min_p", "eval_every_s", "deadline_s", "reserve_s"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(D, name))
    for name in ("depths", "seq_len", "batch_size", "warmup_steps", "max_steps", "corpus_mb", "code_tokens",
                 "requests", "eval_requests", "eval_code_rows", "eval_batch", "max_new", "max_prompt",
                 "log_every", "loss_chunk", "part_mib", "seed"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(D, name))
    ap.add_argument("--init", default=D.init, choices=sorted(INITS), help="how the head starts")
    ap.add_argument("--qtype", default=D.qtype, choices=["Q8_0", "F16", "F32"], help="the sidecar's matrices")
    args = ap.parse_args(argv)
    if not Path(args.model).is_file():
        ap.error(f"{args.model}: no such file")
    if not 1 <= args.depths <= 5 or args.seq_len < args.depths + 2 or args.batch_size < 1:
        ap.error("need 1 <= --depths <= 5, --seq-len > depths + 1 and --batch-size >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gguf import GGMLQuantizationType
    t_start = time.monotonic()
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    out, work = Path(args.out), private_dir(Path(args.work_dir).expanduser())
    out.mkdir(parents=True, exist_ok=True)
    enc = ChatEncoder(args.model)
    prep = prepare_data(args, enc)
    teacher = Teacher.from_gguf(args.model, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                max_len=max(args.seq_len, args.max_prompt + args.max_new + 1))
    cfg = teacher.cfg
    log(f"teacher: {cfg.arch}, {cfg.n_layers} layers, D={cfg.d_model}, vocab {cfg.vocab_size}, on {dev}")
    code_rows = pack(prep["code"], args.seq_len, enc.sep_id, args.seed)        # [N, T]
    head = MTPHead(MTPConfig.from_model(cfg, cfg.d_ff or cfg.d_ff_expert)).to(dev)
    h = teacher.forward(code_rows[:4].to(dev))[:, 1:]                          # [4, T-1, D] (not position 0)
    h_scale = float(h.float().pow(2).mean(-1).sqrt().median())
    INITS[args.init](head, teacher, h_scale, args.seed)
    log(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters, init {args.init} "
        f"(last layer {cfg.n_layers - 1}), h scale {h_scale:.3f}")
    smoke_step(args, teacher, head, code_rows[:2].to(dev))
    sources, evals, stats = finish_data(args, teacher, enc, prep, code_rows)
    del prep
    log(f"data: {json.dumps(stats)}")
    sampler = RowSampler(sources, {"code": 1 - args.chat_share, "chat": args.chat_share}, args.seed)
    eval_init = guarded("evaluation", lambda: run_evals(args, teacher, head, evals), {})
    if not eval_init:
        evals = {}
    # the whole run ends by deadline_s: training stops early enough for the final
    # evaluation and the export (a call killed at its limit would bring nothing back)
    stop_at = t_start + args.deadline_s - args.reserve_s
    if time.monotonic() + args.time_budget_s > stop_at:
        log(f"training shortened to {stop_at - time.monotonic():.0f}s to end within --deadline-s {args.deadline_s:.0f}")
    t_train = time.monotonic()
    curve = train(args, teacher, head, sampler, evals, stop_at)
    train_s = time.monotonic() - t_train
    name = args.sidecar_name or f"{Path(args.model).stem}.mtp.gguf"
    steps, tokens = max((r["step"], r["tokens"]) for r in curve) if curve else (0, 0)
    meta = {
        "alphallama.training.command": shlex.join(["python", "-m", "alphallama.train.distill_mtp", *sys.argv[1:]]),
        "alphallama.training.date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "alphallama.training.kind": "self-distillation (frozen teacher, KL to its own distribution per depth)",
        "alphallama.training.teacher_sha256": file_sha256(args.model),
        "alphallama.training.steps": steps,
        "alphallama.training.tokens": tokens,
        "alphallama.training.depths": args.depths,
        "alphallama.training.commit": os.environ.get("GIT_COMMIT", "unknown"),
    }
    path = work / name
    write_sidecar(path, head, arch=cfg.arch, n_layers=cfg.n_layers, ctx_len=cfg.ctx_len, metadata=meta,
                  qtype=GGMLQuantizationType[args.qtype])
    sums = split_file(path, out, args.part_mib << 20)
    log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) as parts in {out}")
    eval_final = guarded("evaluation", lambda: run_evals(args, teacher, head, evals), {})
    result = {"sidecar": name, "sidecar_bytes": path.stat().st_size, "sidecar_sha256": file_sha256(str(path)),
              "sha256_file": sums.name, "metadata": meta, "args": vars(args), "device": str(dev),
              "commit": meta["alphallama.training.commit"], "host": host_state(),
              "data": stats, "h_scale": h_scale,
              "train_s": train_s, "total_s": time.monotonic() - t_start,
              "defaults": asdict(D), "curve": curve, "eval_init": eval_init, "eval_final": eval_final}
    (out / "distill_curves.json").write_text(json.dumps(result, indent=1))
    log(f"done: {steps} steps, {tokens / 1e6:.1f}M tokens in {train_s:.0f}s; total {result['total_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

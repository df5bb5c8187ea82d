"""Answers to the student's code-writing requests, written by a real coder model (sequence-
level distillation; docs/decisions/embedded-model.md, "The next run's design"):

    python -m alphallama.train.teach TEACHER.gguf --requests N --deadline-s S -o answers.jsonl.gz \\
        [--device auto] [--batch B] [--max-new 256] [--root LABEL=PATH ...] [--corpus-mb MB]

The requests are made as the training data makes them (instruct.FunctionPool over the
documented functions of the training files: the plain-language phrasings of requests.py
and the signature forms, closed functions first, every function asked once before any
twice), from the corpus the trainer reads (pipeline.corpus_files: the held-out files stay
out). Each is rendered with the TEACHER's own chat template, answered greedily in batches
(distill_generate.generate_all, which stops between batches at the deadline) and kept when
it ended by itself and teach_answers.judge keeps it (its code parses, defines a function,
reads only builtins and what it imports or defines). Writes the kept {"request", "answer"}
lines and, beside them, answers.summary.json (requests, answered, kept, why the others were
dropped, seconds, the teacher's name and sha256). The deadline counts from the start:
whatever has been answered by then is judged and written.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import DEFAULTS
from .distill_data import ChatEncoder, encode_parallel
from .distill_generate import generate_all
from .distill_requests import _map
from .distill_teacher import Teacher
from .instruct import FunctionPool, function_cases
from .parts import sha256_file
from .pipeline import corpus_files, example_texts
from .teach_answers import REASONS, closed_fence, judge, summary_path, write_answers

# Asked of the teacher only (the student's examples keep their own system prompts): the answer
# kept is its code, and prose around it spends the --max-new budget (an answer cut before its
# code block closes is dropped).
SYSTEM = "You are a careful Python programmer. Answer with one Python code block and no explanation."


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_requests(texts: list[str], n: int, seed: int, workers: int = 0) -> list[str]:
    """Up to n distinct code-writing requests, as the training data asks them: the files
    are parsed in a shuffled order (in `workers` processes) only until they hold n closed
    functions, and a FunctionPool of their cases asks them in its order."""
    rng = random.Random(seed)
    order = rng.sample(range(len(texts)), len(texts))
    cases, closed = [], 0
    parsed = _map(function_cases, (texts[i] for i in order), workers)
    for found in parsed:
        cases += found
        closed += sum(c.closed for c in found)
        if closed >= n:
            break
    if hasattr(parsed, "close"):
        parsed.close()   # stops the workers early
    pool = FunctionPool([], rng, 0, cases=cases)
    out: dict[str, None] = {}   # insertion-ordered set: two files' identical docstrings ask once
    while len(out) < n and (e := pool.next()) is not None:
        out[e.prompt] = None
    return list(out)


@contextmanager
def _stop_on_signals(event: threading.Event):
    """SIGTERM and SIGINT set `event` while inside (the main thread only; elsewhere as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def handler(signum, frame):
        log(f"signal {signum}: stopping after this batch")
        event.set()
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def answer(args, requests: list[str], deadline: float) -> tuple[list[tuple[str, bool] | None], dict]:
    """(the teacher's answer text, whether it is whole) for each request (None: not reached
    by the deadline), and generation statistics. An answer cut at --max-new is whole when
    its first code block had closed (only prose after it was lost)."""
    enc = ChatEncoder(args.teacher)
    tasks = [("chat", q, None, args.system) for q in requests]
    prompts = [p for p, _ in encode_parallel(args.teacher, tasks, args.workers)]
    fits = [i for i, p in enumerate(prompts) if len(p) <= args.max_prompt]
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    t = time.monotonic()
    longest = max((len(prompts[i]) for i in fits), default=1)
    teacher = Teacher.from_gguf(args.teacher, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                max_len=longest + args.max_new + 1)
    load_s = time.monotonic() - t
    log(f"teacher: {teacher.cfg.arch}, {teacher.cfg.n_layers} layers, on {dev} ({load_s:.1f} s); "
        f"{len(fits)} of {len(prompts)} prompts fit {args.max_prompt} tokens")
    stops = set(enc.tok.stop_ids) | {enc.end_id}
    t = time.monotonic()
    asked_to_stop = threading.Event()    # SIGTERM / SIGINT: finish the batch, then write what was answered
    with _stop_on_signals(asked_to_stop):
        gen = generate_all(teacher, [prompts[i] for i in fits], args.max_new, sorted(stops), deadline,
                           max_batch=args.batch, seed=args.seed, log=log, stop=asked_to_stop.is_set)
    gen_s = time.monotonic() - t
    texts: list[tuple[str, bool] | None] = [None] * len(requests)
    stats = Counter(answered=0, unreached=0, tokens=0)
    for i, ids in zip(fits, gen):
        if ids is None:
            stats["unreached"] += 1
            continue
        stats["answered"] += 1
        stats["tokens"] += len(ids)
        ended = bool(ids) and ids[-1] in stops
        text = enc.tok.decode(ids[:-1] if ended else ids, special=False)
        texts[i] = (text, ended or closed_fence(text))
    return texts, {**stats, "stopped_by_signal": asked_to_stop.is_set(),
                   "too_long_prompts": len(prompts) - len(fits), "device": str(dev),
                   "load_s": round(load_s, 1), "generate_s": round(gen_s, 1),
                   "tok_s": round(stats["tokens"] / max(gen_s, 1e-9), 1)}


def run(args) -> dict:
    t0 = time.monotonic()
    deadline = t0 + args.deadline_s
    files = corpus_files(args)
    texts = example_texts([f.text for f in files if not f.held_out])
    requests = make_requests(texts, args.requests, args.seed, args.workers)
    log(f"requests: {len(requests)} from {len(texts)} training files ({sum(f.held_out for f in files)} "
        f"held out), {time.monotonic() - t0:.1f} s")
    texts_out, stats = answer(args, requests, deadline)
    why: Counter = Counter()
    rows, samples = [], {}
    for q, got in zip(requests, texts_out):
        if got is None:
            continue
        a, whole = got
        kept, reason = judge(a) if whole else (None, "unfinished")
        why[reason] += 1
        if kept is not None:
            rows.append((q, kept))
        if len(samples.setdefault(reason, [])) < 2:   # what the teacher wrote, to read afterwards
            samples[reason].append({"request": q[:400], "answer": a[:1200]})
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_answers(out, rows)
    summary = {"teacher": Path(args.teacher).name, "teacher_sha256": sha256_file(args.teacher),
               "requests": len(requests), "answered": stats.pop("answered"),
               "finished": sum(why.values()) - why["unfinished"],
               "kept": len(rows), "reasons": {r: why[r] for r in (*REASONS, "unfinished")},
               "seconds": round(time.monotonic() - t0, 1), "deadline_s": args.deadline_s,
               "stopped_by_deadline": stats["unreached"] > 0, "batch": args.batch, "max_new": args.max_new,
               "seed": args.seed, **stats,
               "system": args.system, "output": out.name, "output_sha256": sha256_file(out), "samples": samples,
               "command": "python -m alphallama.train.teach " + shlex.join(sys.argv[1:])}
    summary_path(out).write_text(json.dumps(summary, indent=1))
    log(f"kept {summary['kept']} of {summary['answered']} answered ({summary['requests']} requests) in "
        f"{summary['seconds']} s: {summary['reasons']}; {out} (+ {summary_path(out).name})")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    T = DEFAULTS.train
    ap = argparse.ArgumentParser(prog="python -m alphallama.train.teach", description=__doc__.split("\n\n")[0])
    ap.add_argument("teacher", help="the coder model (GGUF), e.g. Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument("-o", "--output", required=True, help="the answers file (gzipped JSON lines)")
    ap.add_argument("--requests", type=int, default=4096, help="code-writing requests to ask")
    ap.add_argument("--deadline-s", type=float, default=150.0,
                    help="wall seconds from the start: no batch is started after it")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=256, help="requests a batch (fewer for long prompts)")
    ap.add_argument("--max-new", type=int, default=256, help="tokens an answer; longer ones are dropped")
    ap.add_argument("--max-prompt", type=int, default=512, help="longer request prompts are not asked")
    ap.add_argument("--system", default=SYSTEM,
                    help="the teacher's system message ('': its template's default); only the code is kept")
    ap.add_argument("--root", action="append", help="LABEL=PATH source roots, as the trainer's --root")
    ap.add_argument("--corpus-mb", type=int, default=T.corpus_mb, help="as the trainer's")
    ap.add_argument("--seed", type=int, default=T.seed)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes parsing files and tokenizing prompts (0: none)")
    args = ap.parse_args(argv)
    if not Path(args.teacher).is_file():
        ap.error(f"{args.teacher}: no such file")
    if args.requests < 1 or args.batch < 1 or args.max_new < 1:
        ap.error("--requests, --batch and --max-new must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (OSError, ValueError) as e:
        print(f"alphallama.train.teach: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

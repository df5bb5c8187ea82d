"""Held-out evaluation of a trained model with the engine (greedy): the exact-output rate
per edit-task kind on files that never entered training, plus sample answers to a ChatML
request and a Python continuation.

    python -m alphallama.train.evaluate MODEL --heldout heldout.jsonl.gz --per-kind 12 -o OUT.json

Generation for a task stops as soon as its text stops being a prefix of the expected
answer: the task is then not exact whatever follows, so the exact rate is what full
greedy decoding gives, at a fraction of the CPU time. The matched share of the expected
answer is recorded too.
"""
from __future__ import annotations

import argparse
import gzip
import json
import platform
import random
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone

from .edits import TASKS
from .instruct import KINDS, make_edit

SAMPLE_CHAT = "Write a Python function that returns True if a string is a palindrome, ignoring case and spaces."
SAMPLE_CODE = 'import os\n\n\ndef list_python_files(root):\n    """Return the paths of all .py files under root."""\n'


def load_heldout(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def make_tasks(texts: list[str], per_kind: int, seed: int, max_chars: int, kinds=KINDS, fits=None):
    """per_kind checked tasks of each kind; `fits(edit)` drops those that would not fit the
    model's context (prompt + answer)."""
    rng = random.Random(seed)
    out = []
    for kind in kinds:
        got, tries = 0, 0
        while got < per_kind and tries < 200 * per_kind:
            tries += 1
            e = make_edit(kind, rng.choice(texts), rng, max_chars)
            if e is not None and (kind == "write_function" or TASKS[kind].check(e)) and (fits is None or fits(e)):
                out.append(e)
                got += 1
    return out


def run_task(engine, edit, slack: int = 16) -> dict:
    """Greedy answer to one task, stopped at the first departure from the expected text."""
    ids = engine.encode_chat([{"role": "user", "content": edit.prompt}])
    want = edit.answer
    budget = len(engine.tokenizer.encode(want)) + slack
    if len(ids) + budget >= engine.ctx_size:
        return {"skipped": "does not fit the context"}
    det = engine.tokenizer.stream()
    text, n = "", 0
    for tok in engine.generate(ids, budget):
        n += 1
        text += det.feed(tok)
        if not want.startswith(text):
            break
    else:
        text += det.flush()
    common = 0
    for a, b in zip(text, want):
        if a != b:
            break
        common += 1
    return {"exact": text == want, "matched_chars": common, "answer_chars": len(want),
            "prompt_tokens": len(ids), "generated_tokens": n}


def sample(engine, max_tokens: int = 120) -> dict:
    chat_ids = engine.encode_chat([{"role": "user", "content": SAMPLE_CHAT}])
    code_ids = engine.encode_prompt(SAMPLE_CODE)
    return {"chat": {"prompt": SAMPLE_CHAT, "output": engine.tokenizer.decode(list(engine.generate(chat_ids, max_tokens)))},
            "continuation": {"prompt": SAMPLE_CODE,
                             "output": engine.tokenizer.decode(list(engine.generate(code_ids, max_tokens)))}}


def main(argv=None) -> int:
    from ..engine import Engine
    p = argparse.ArgumentParser(prog="python -m alphallama.train.evaluate")
    p.add_argument("model")
    p.add_argument("--heldout", required=True, help="heldout.jsonl.gz written by the training run")
    p.add_argument("--per-kind", type=int, default=12)
    p.add_argument("--max-chars", type=int, default=700, help="snippet size of code tasks")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (on a busy machine one thread is many times faster than two)")
    p.add_argument("--commit", default=None)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device=args.device)
    texts = [r["text"] for r in load_heldout(args.heldout)]
    def fits(e) -> bool:
        n = len(engine.encode_chat([{"role": "user", "content": e.prompt}]))
        return n + len(engine.tokenizer.encode(e.answer)) + 16 < engine.ctx_size

    tasks = make_tasks(texts, args.per_kind, args.seed, args.max_chars, fits=fits)
    per = defaultdict(list)
    t0 = time.time()
    for i, e in enumerate(tasks):
        r = run_task(engine, e)
        per[e.kind].append(r)
        print(f"{i + 1}/{len(tasks)} {e.kind}: {r}", flush=True)
    table = {}
    for kind, rs in per.items():
        done = [r for r in rs if "skipped" not in r]
        table[kind] = {"tasks": len(done), "exact": sum(r["exact"] for r in done),
                       "exact_rate": round(sum(r["exact"] for r in done) / max(1, len(done)), 3),
                       "matched_share": round(sum(r["matched_chars"] / r["answer_chars"] for r in done)
                                              / max(1, len(done)), 3),
                       "skipped": len(rs) - len(done)}
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
           "commit": args.commit, "host": platform.processor() or platform.machine(), "device": args.device,
           "command": "python -m alphallama.train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv),
           "method": "greedy with the engine; held-out files only; generation stops at the first "
                     "departure from the expected answer (exactness is unaffected)",
           "per_kind": table, "tasks": {k: v for k, v in per.items()}, "samples": sample(engine),
           "seconds": round(time.time() - t0, 1)}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    for kind, row in table.items():
        print(f"{kind:16} {row['exact']:3d}/{row['tasks']:<3d} exact  matched {row['matched_share']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Held-out evaluation of a trained model with the engine (greedy): the exact-output rate
per edit-task kind on files that never entered training, the held-out loss in bits per
byte, and greedy answers to short chat requests and continuations with their repetition
share; with --baseline, a second model on the same tasks, side by side.

    python -m alphallama.train.evaluate NEW --baseline OLD --heldout heldout.jsonl.gz -o OUT.json

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
from .quality import answer_code, defines_function, heldout_bits_per_byte, repeat_share

# greedy samples: short chat requests and plain continuations, scored by quality.py
SAMPLE_CHATS = ("Write a Python function that reverses a string.",
                "Write a Python function that returns True if a string is a palindrome, ignoring case and spaces.",
                "Write a Python function that counts the words in a text file.",
                "Write a Python function to compute the factorial of n.")
SAMPLE_CODES = ('import os\n\n\ndef list_python_files(root):\n    """Return the paths of all .py files under root."""\n',
                'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')


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


def samples(engine, max_tokens: int = 160) -> dict:
    """Greedy outputs of SAMPLE_CHATS and SAMPLE_CODES with their repetition share (and,
    for chat, whether the answer's code parses and defines a function)."""
    def gen(ids):
        return engine.tokenizer.decode(list(engine.generate(ids, max_tokens)))
    chats = []
    for p in SAMPLE_CHATS:
        out = gen(engine.encode_chat([{"role": "user", "content": p}]))
        chats.append({"prompt": p, "output": out, "repeat_share": repeat_share(out),
                      "defines_function": defines_function(answer_code(out))})
    codes = []
    for p in SAMPLE_CODES:
        out = gen(engine.encode_prompt(p))
        codes.append({"prompt": p, "output": out, "repeat_share": repeat_share(out)})
    return {"max_tokens": max_tokens, "chat": chats, "continuation": codes,
            "chat_defines_function": sum(c["defines_function"] for c in chats),
            "mean_repeat_share": round(sum(x["repeat_share"] for x in chats + codes) / len(chats + codes), 3)}


def evaluate_model(engine, tasks, heldout_texts: list[str], windows: int) -> dict:
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
    return {"per_kind": table, "tasks": dict(per), "heldout": heldout_bits_per_byte(engine, heldout_texts, windows),
            "samples": samples(engine), "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    from ..engine import Engine
    p = argparse.ArgumentParser(prog="python -m alphallama.train.evaluate")
    p.add_argument("model")
    p.add_argument("--baseline", default=None,
                   help="a second model evaluated on the same tasks, reported side by side as 'before'")
    p.add_argument("--heldout", required=True, help="heldout.jsonl.gz written by the training run")
    p.add_argument("--per-kind", type=int, default=12)
    p.add_argument("--max-chars", type=int, default=700, help="snippet size of code tasks")
    p.add_argument("--windows", type=int, default=24, help="held-out files scored in bits per byte")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (on a busy machine one thread is many times faster than two)")
    p.add_argument("--commit", default=None)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    models = {"after": args.model} | ({"before": args.baseline} if args.baseline else {})
    engines = {k: Engine.load(m, device=args.device) for k, m in models.items()}
    texts = [r["text"] for r in load_heldout(args.heldout)]

    def fits(e) -> bool:    # in every model's context, with its own tokenizer
        return all(len(g.encode_chat([{"role": "user", "content": e.prompt}])) + len(g.tokenizer.encode(e.answer))
                   + 16 < g.ctx_size for g in engines.values())

    tasks = make_tasks(texts, args.per_kind, args.seed, args.max_chars, fits=fits)
    held = random.Random(args.seed).sample(texts, min(args.windows, len(texts)))
    results = {k: evaluate_model(g, tasks, held, args.windows) for k, g in engines.items()}
    side = {kind: {k: {f: r["per_kind"][kind][f] for f in ("exact", "tasks", "matched_share")}
                   for k, r in results.items()} for kind in results["after"]["per_kind"]}
    side["heldout_bits_per_byte"] = {k: r["heldout"]["bits_per_byte"] for k, r in results.items()}
    side["chat_defines_function"] = {k: f"{r['samples']['chat_defines_function']}/{len(SAMPLE_CHATS)}"
                                     for k, r in results.items()}
    side["mean_repeat_share"] = {k: r["samples"]["mean_repeat_share"] for k, r in results.items()}
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "models": models,
           "commit": args.commit, "host": platform.processor() or platform.machine(), "device": args.device,
           "command": "python -m alphallama.train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv),
           "method": "greedy with the engine; held-out files only; generation stops at the first "
                     "departure from the expected answer (exactness is unaffected); held-out loss in "
                     "bits per UTF-8 byte (tokenizer-independent) over the first context of each file",
           "side_by_side": side, "results": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    for key, row in side.items():
        print(f"{key:22} " + "  ".join(f"{k}: {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

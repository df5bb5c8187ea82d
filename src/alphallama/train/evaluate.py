"""Held-out evaluation of a trained model with the engine (greedy): the exact-output rate
per edit-task kind on files that never entered training, the held-out loss in bits per
byte, greedy answers to short chat requests (does the answer define a function, and is
it plausible: names.py) and greedy continuations of held-out file prefixes, with their
repetition share; with a baseline, the same tasks side by side (before / after).

    python -m alphallama.train.evaluate NEW --baseline OLD --heldout heldout.jsonl.gz -o OUT.json
    python -m alphallama.train.evaluate OLD --heldout H -o before.json          # one model ...
    python -m alphallama.train.evaluate NEW --baseline-json before.json --heldout H -o OUT.json
                                                  # ... and later the other, against its record

--jobs N spreads the work over N processes (one torch thread each). Generation for a task
stops as soon as its text stops being a prefix of the expected answer: the task is then
not exact whatever follows, so the exact rate is what full greedy decoding gives, at a
fraction of the CPU time. The matched share of the expected answer is recorded too.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import multiprocessing as mp
import platform
import random
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from typing import NamedTuple

from .edits import TASKS
from .instruct import KINDS, make_edit
from .names import plausible
from .quality import answer_code, defines_function, heldout_bits_per_byte, repeat_share

# greedy samples: short chat requests and plain continuations, scored by quality.py
SAMPLE_CHATS = ("Write a Python function that reverses a string.",
                "Write a Python function that returns True if a string is a palindrome, ignoring case and spaces.",
                "Write a Python function that counts the words in a text file.",
                "Write a Python function to compute the factorial of n.")
SAMPLE_CODES = ('import os\n\n\ndef list_python_files(root):\n    """Return the paths of all .py files under root."""\n',
                'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')


class Task(NamedTuple):
    kind: str
    prompt: str
    answer: str


def load_heldout(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def make_tasks(texts: list[str], per_kind: int, seed: int, max_chars: int, kinds=KINDS, fits=None) -> list[Task]:
    """per_kind checked tasks of each kind; `fits(task)` drops those that would not fit the
    model's context (prompt + answer)."""
    rng = random.Random(seed)
    out = []
    for kind in kinds:
        got, tries = 0, 0
        while got < per_kind and tries < 200 * per_kind:
            tries += 1
            e = make_edit(kind, rng.choice(texts), rng, max_chars)
            if e is None or not (kind == "write_function" or TASKS[kind].check(e)):
                continue
            t = Task(e.kind, e.prompt, e.answer)
            if fits is None or fits(t):
                out.append(t)
                got += 1
    return out


def continuation_prompts(texts: list[str], n: int, seed: int, max_chars: int = 2000) -> list[str]:
    """n held-out file prefixes that end just after a function's header and docstring
    (the first documented function of the file, if its prefix is at most max_chars), from
    files in a random order of `seed`: where a plain continuation writes a function body."""
    out = []
    for text in random.Random(seed).sample(texts, len(texts)):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            continue
        funcs = sorted((f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and ast.get_docstring(f) and len(f.body) > 1), key=lambda f: f.lineno)
        if funcs:
            prefix = "\n".join(text.splitlines()[:funcs[0].body[0].end_lineno]) + "\n"
            if len(prefix) <= max_chars:
                out.append(prefix)
        if len(out) == n:
            break
    return out


def run_task(engine, task: Task, slack: int = 16) -> dict:
    """Greedy answer to one task, stopped at the first departure from the expected text."""
    ids = engine.encode_chat([{"role": "user", "content": task.prompt}])
    want = task.answer
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


def _item(engine, item: tuple, max_tokens: int):
    """One unit of work: ("task", Task) | ("bpb", text) | ("chat" | "code" | "heldout", prompt)."""
    what, x = item
    if what == "task":
        return run_task(engine, x)
    if what == "bpb":
        return heldout_bits_per_byte(engine, [x], 1)
    try:
        ids = engine.encode_chat([{"role": "user", "content": x}]) if what == "chat" else engine.encode_prompt(x)
        if len(ids) >= engine.ctx_size:
            raise ValueError(f"{len(ids)} prompt tokens")
    except ValueError as e:       # ContextOverflow: a small model's context (the smoke runs)
        return {"prompt": x, "skipped": f"does not fit the context: {e}"}
    out = engine.tokenizer.decode(list(engine.generate(ids, max_tokens)))
    r = {"prompt": x, "output": out, "repeat_share": repeat_share(out)}
    if what == "chat":
        code = answer_code(out)
        r |= {"defines_function": defines_function(code), "plausible": plausible(code)}
    return r


def _worker(args: tuple) -> list:
    model, device, threads, items, max_tokens = args
    import torch

    from ..engine import Engine
    torch.set_num_threads(threads)
    engine = Engine.load(model, device=device)
    return [_item(engine, it, max_tokens) for it in items]


def _mean(xs) -> float:
    xs = list(xs)
    return round(sum(xs) / max(1, len(xs)), 3)


def evaluate_model(model: str, device: str, tasks: list[Task], held: list[str], prompts: list[str],
                   jobs: int = 1, threads: int = 1, max_tokens: int = 160) -> dict:
    """Every measure of one model; the work spread over `jobs` processes."""
    jobs = max(1, jobs)
    items = ([("task", t) for t in tasks] + [("bpb", x) for x in held] + [("chat", p) for p in SAMPLE_CHATS]
             + [("code", p) for p in SAMPLE_CODES] + [("heldout", p) for p in prompts])
    t0 = time.time()
    shares = [items[i::jobs] for i in range(jobs)]
    if jobs <= 1:
        parts = [_worker((model, device, threads, items, max_tokens))]
    else:
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            parts = list(pool.map(_worker, [(model, device, threads, s, max_tokens) for s in shares]))
    res = [None] * len(items)
    for i, part in enumerate(parts):
        for j, r in enumerate(part):
            res[i + j * len(parts)] = r
    by = defaultdict(list)
    for (what, x), r in zip(items, res):
        by[what].append((x, r))
    per = defaultdict(list)
    for t, r in by["task"]:
        per[t.kind].append(r)
    table = {}
    for kind, rs in per.items():
        done = [r for r in rs if "skipped" not in r]
        table[kind] = {"tasks": len(done), "exact": sum(r["exact"] for r in done),
                       "exact_rate": round(sum(r["exact"] for r in done) / max(1, len(done)), 3),
                       "matched_share": round(sum(r["matched_chars"] / r["answer_chars"] for r in done)
                                              / max(1, len(done)), 3),
                       "skipped": len(rs) - len(done)}
    bpb = [r for _, r in by["bpb"]]
    nats = sum(r["nats"] for r in bpb)
    n_bytes, n_tok = sum(r["bytes"] for r in bpb), sum(r["tokens"] for r in bpb)
    chats, codes, conts = ([r for _, r in by[k] if "skipped" not in r] for k in ("chat", "code", "heldout"))
    samples = {"max_tokens": max_tokens, "chat": chats, "continuation": codes, "heldout_continuation": conts,
               "chat_defines_function": sum(c["defines_function"] for c in chats),
               "chat_plausible": sum(c["plausible"] for c in chats),
               "chat_repeat_share": _mean(c["repeat_share"] for c in chats),
               "heldout_continuation_repeat_share": _mean(c["repeat_share"] for c in conts),
               "mean_repeat_share": _mean(x["repeat_share"] for x in chats + codes)}
    return {"per_kind": table, "tasks": dict(per),
            "heldout": {"bits_per_byte": round(nats / 0.6931471805599453 / max(1, n_bytes), 4),
                        "nats_per_token": round(nats / max(1, n_tok), 4), "windows": len(bpb),
                        "bytes": n_bytes, "tokens": n_tok},
            "samples": samples, "seconds": round(time.time() - t0, 1), "jobs": jobs}


def side_by_side(results: dict) -> dict:
    """{measure: {label: value}} for the labels of `results` ('after', 'before')."""
    side = {kind: {k: {f: r["per_kind"].get(kind, {}).get(f) for f in ("exact", "tasks", "matched_share")}
                   for k, r in results.items()} for kind in results["after"]["per_kind"]}
    s = {k: r["samples"] for k, r in results.items()}
    side["heldout_bits_per_byte"] = {k: r["heldout"]["bits_per_byte"] for k, r in results.items()}
    side["chat_defines_function"] = {k: f"{v['chat_defines_function']}/{len(v['chat'])}" for k, v in s.items()}
    side["chat_plausible"] = {k: f"{v['chat_plausible']}/{len(v['chat'])}" for k, v in s.items()}
    side["chat_repeat_share"] = {k: v["chat_repeat_share"] for k, v in s.items()}
    side["heldout_continuation_repeat_share"] = {k: f"{v['heldout_continuation_repeat_share']} "
                                                 f"({len(v['heldout_continuation'])})" for k, v in s.items()}
    side["mean_repeat_share"] = {k: v["mean_repeat_share"] for k, v in s.items()}   # 4 chats + 2 codes, as before
    return side


def _fmt(v) -> str:
    return f"{v['exact']}/{v['tasks']} ({v['matched_share']})" if isinstance(v, dict) else str(v)


def print_table(side: dict, out=None) -> None:
    out = out or sys.stdout
    labels = [k for k in ("before", "after") if k in next(iter(side.values()))]
    print(f"{'measure':36}" + "".join(f"{k:>18}" for k in labels), file=out)
    for key, row in side.items():
        print(f"{key:36}" + "".join(f"{_fmt(row[k]):>18}" for k in labels), file=out)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m alphallama.train.evaluate")
    p.add_argument("model")
    p.add_argument("--baseline", default=None,
                   help="a second model evaluated on the same tasks, reported side by side as 'before'")
    p.add_argument("--baseline-json", default=None,
                   help="an earlier evaluation's output: its model is 'before', its tasks are these tasks")
    p.add_argument("--heldout", required=True, help="heldout.jsonl.gz written by the training run")
    p.add_argument("--per-kind", type=int, default=12)
    p.add_argument("--max-chars", type=int, default=700, help="snippet size of code tasks")
    p.add_argument("--windows", type=int, default=24, help="held-out files scored in bits per byte")
    p.add_argument("--continuations", type=int, default=8, help="held-out file prefixes continued greedily")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens a chat answer or continuation")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1, help="processes sharing the work (one model each)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads a process (on a busy machine one thread is many times faster than two)")
    p.add_argument("--commit", default=None)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    if args.baseline and args.baseline_json:
        p.error("--baseline and --baseline-json exclude each other")
    from ..engine import Engine
    texts = [r["text"] for r in load_heldout(args.heldout)]
    setup = {"heldout_sha256": _sha256(args.heldout), "per_kind": args.per_kind, "max_chars": args.max_chars,
             "windows": args.windows, "continuations": args.continuations, "max_tokens": args.max_tokens,
             "seed": args.seed}
    base = None
    if args.baseline_json:
        with open(args.baseline_json) as f:
            base = json.load(f)
        if base.get("setup") != setup:
            raise SystemExit(f"{args.baseline_json}: made with {base.get('setup')}, not {setup}")
        tasks = [Task(*t) for t in base["task_set"]]
    else:
        engines = [Engine.load(m, device="cpu") for m in (args.model, args.baseline) if m]

        def fits(t: Task) -> bool:    # in every model's context, with its own tokenizer
            return all(len(g.encode_chat([{"role": "user", "content": t.prompt}])) + len(g.tokenizer.encode(t.answer))
                       + 16 < g.ctx_size for g in engines)
        tasks = make_tasks(texts, args.per_kind, args.seed, args.max_chars, fits=fits)
        del engines
    held = random.Random(args.seed).sample(texts, min(args.windows, len(texts)))
    prompts = continuation_prompts(texts, args.continuations, args.seed)
    models = {"after": args.model} | ({"before": args.baseline} if args.baseline else {})
    results = {k: evaluate_model(m, args.device, tasks, held, prompts, args.jobs, args.threads, args.max_tokens)
               for k, m in models.items()}
    if base is not None:
        models["before"] = base["models"]["after"]
        results["before"] = base["results"]["after"]
    side = side_by_side(results) if "before" in results else None
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "models": models,
           "commit": args.commit, "host": platform.processor() or platform.machine(), "device": args.device,
           "command": "python -m alphallama.train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv),
           "method": "greedy with the engine; held-out files only; generation stops at the first "
                     "departure from the expected answer (exactness is unaffected); held-out loss in "
                     "bits per UTF-8 byte (tokenizer-independent) over the first context of each file; "
                     "'plausible': the answer's functions read only builtins and names it binds (names.py)",
           "setup": setup, "task_set": [list(t) for t in tasks], "side_by_side": side, "results": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    if side is not None:
        print_table(side)
    else:
        print_table(side_by_side({"after": results["after"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

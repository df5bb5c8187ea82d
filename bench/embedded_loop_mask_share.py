"""What the loops' unlikelihood mask (train/unlikely.repeated) would mark in the edits' own
answers: per edit kind, the share of the expected answer's tokens marked, the task's prompt as
the prefix, at each n-gram length. A share above 0 means the term would call that copy a loop.

    python bench/embedded_loop_mask_share.py EVAL.json [-m MODEL.gguf] [-o OUT.json]
(EVAL.json: any train.evaluate record; its task_set is read.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
from datetime import date
from pathlib import Path

import torch

from alphallama.engine import Engine
from alphallama.train.unlikely import repeated

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "src/alphallama/data/alphallama-embedded.gguf"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_json")
    ap.add_argument("-m", "--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--ngrams", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("-o", "--out", default=None)
    args = ap.parse_args()
    tasks = json.load(open(args.eval_json))["task_set"]
    tok = Engine.load(args.model).tokenizer
    shares: dict[str, dict[int, list[float]]] = {}
    for kind, prompt, answer in tasks:
        p, a = tok.encode(prompt), tok.encode(answer)
        seq = torch.tensor([p + a])
        for n in args.ngrams:
            marked = repeated(seq, len(p), n)[0, len(p):].float().mean().item()
            shares.setdefault(kind, {}).setdefault(n, []).append(marked)
    table = {k: {n: round(sum(v) / len(v), 3) for n, v in d.items()} for k, d in shares.items()}
    for k, d in table.items():
        print(f"{k:16}", "  ".join(f"n={n}: {x:.3f}" for n, x in d.items()))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps({"date": str(date.today()), "commit": commit, "device": "cpu",
                                              "command": "python bench/embedded_loop_mask_share.py " + args.eval_json,
                                              "model": Path(args.model).name, "mask_share": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Price a kernel family on real speculative rounds without a device: each prompt of a
committed spec_suite run at its mean round width (1 + drafts proposed / rounds), times a
committed ms-per-width curve of each family on the 8B shape (linear between measured
widths). -> time ratio (control / candidate) per prompt, geomean per set. An estimate:
the widths are another model's (Qwen2.5-Coder-0.5B) and a width policy priced by the
candidate's costs would pick wider rounds.

    python bench/price_widths.py   # writes bench/results/price_widths-<date>.json
    python bench/price_widths.py --curves gpu_decode_arms-qwen3-8b-<run>.json --candidate default/fast --tag fast
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import time
from pathlib import Path

import numpy as np

RES = Path(__file__).resolve().parent / "results"
SUITE = "spec_suite-qwen-cuda-h200-20261201-161905.json"
CURVES = "gpu_decode_arms-qwen3-8b-20261201-214103.json"     # default and mma-wide1 at W 1-16
NEW_W1 = ("gpu_decode_arms-qwen3-8b-20261202-040314.json", "default/mma-wide")   # the W-aware q8k tile's W = 1


def curve(arm: dict) -> tuple[list[int], list[float]]:
    ws = sorted(int(w) for w in arm["ms_per_round"] if int(w) <= 16)
    return ws, [arm["ms_per_round"][str(w)] for w in ws]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curves", default=CURVES, help="a gpu_decode_arms JSON under bench/results")
    ap.add_argument("--control", default="default")
    ap.add_argument("--candidate", default="default/mma-wide1")
    ap.add_argument("--tag", default="", help="a suffix for the output's name")
    args = ap.parse_args()
    arms = json.loads((RES / args.curves).read_text())["arms"]
    ws, control = curve(arms[args.control])
    ws_c, cand = curve(arms[args.candidate])
    assert ws == ws_c
    w1 = None
    if (args.curves, args.candidate) == (CURVES, "default/mma-wide1"):    # session 24's pricing, as it was
        w1 = NEW_W1
        cand[0] = json.loads((RES / NEW_W1[0]).read_text())["arms"][NEW_W1[1]]["ms_per_round"]["1"]
    suite = json.loads((RES / SUITE).read_text())
    per_set: dict[str, list[float]] = {}
    rows = []
    for p in suite["prompts"]:
        s = p["ngram"]["spec"]
        s = ast.literal_eval(s) if isinstance(s, str) else s
        width = 1 + s["drafts_proposed"] / s["rounds"]
        ratio = float(np.interp(width, ws, control) / np.interp(width, ws, cand))
        rows.append({"id": p["id"], "set": p["set"], "mean_width": width, "tokens_per_round": s["tokens_per_round"],
                     "time_ratio": ratio})
        for key in (p["set"], "all"):
            per_set.setdefault(key, []).append(ratio)
    geo = {k: math.exp(sum(math.log(r) for r in v) / len(v)) for k, v in per_set.items()}
    out = {"what": __doc__.split("\n\n")[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "inputs": {"suite": SUITE, "curves": args.curves, "control": args.control, "candidate": args.candidate,
                      "candidate_w1": w1},
           "widths": ws, "control_ms": control, "candidate_ms": cand, "geomean_time_ratio": geo, "prompts": rows}
    path = RES / f"price_widths-{time.strftime('%Y%m%d')}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1))
    print(" ".join(f"{k} {v:.2f}" for k, v in geo.items()), "->", path.name)


if __name__ == "__main__":
    main()

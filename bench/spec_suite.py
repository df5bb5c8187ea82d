"""The public arena suite through the Engine, once per speculation arm (plain greedy, the
copy drafter, MTP, and both under the policy), with what each drafter did.

    python bench/spec_suite.py -m MODEL.gguf [--draft-head HEAD.gguf] [--device cuda]
    python bench/spec_suite.py -m models/embedded/x.gguf --device cpu --per-set 2 --max-tokens 48 --no-gate
    python bench/spec_suite.py --replot RESULT.json

Per set (A, V, R, all) and arm: tokens per round, ms per round and tok/s (the plain arm
is the same-session control; DESIGN §8.3: tok/s = tokens per round / ms per round), the
share of rounds each drafter took, per drafter the conditional hit rate and chain
survival per depth, MTP's calibration per depth, the copy's hit rates per match length,
the copy drafter's every-position curves replayed from the plain run (spec/replay.py),
and whether each exact-mode arm's output equals the plain output, per prompt.
Writes spec_suite-<model>-<device>-<time>.json (rewritten after every prompt, so a run cut
short keeps what it measured: "complete" says which) and .png under --out ($OUT, else
bench/results). Supersedes bench/gpu_qwen_suite.py and bench/spec_replay_stats.py.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.bench.engine_bench import copy_bandwidth
from alphallama.bench.suite import load_suite
from alphallama.engine import Engine, Generation
from alphallama.spec.config import SPEC_TYPES, SpecConfig
from alphallama.spec.replay import replay
from alphallama.spec.stats import SpecStats

SETS = ("A", "V", "R", "all")


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 0.0


def parse_arm(text: str, args) -> tuple[str, SpecConfig]:
    """'ngram', 'mtp,ngram', ... optionally '/nogate', '/p0.4' (a fixed gate floor) or
    '/always' (MTP drafts every round: no switch)."""
    kind, _, opt = text.partition("/")
    if kind not in SPEC_TYPES:
        raise SystemExit(f"spec_suite: unknown arm {text!r} (spec types: {', '.join(SPEC_TYPES)})")
    gate, p_min, switch = not args.no_gate, args.spec_p_min, True
    if opt == "nogate":
        gate = False
    elif opt == "always":
        switch = False
    elif opt.startswith("p"):
        p_min = float(opt[1:])
    elif opt:
        raise SystemExit(f"spec_suite: unknown arm option {opt!r} (nogate | always | p<floor>)")
    return text, SpecConfig(kind, draft_max=args.draft_max, ngram_min=args.ngram_min, mtp_depth=args.mtp_depth,
                            mtp_min_p=args.mtp_min_p, mtp_switch=switch, p_min=p_min, gate=gate)


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_engine(args) -> Engine:
    kw = {}
    if args.draft_head:
        if "draft_head" not in inspect.signature(Engine.load).parameters:
            raise SystemExit("spec_suite: this engine has no --draft-head support")
        kw["draft_head"] = args.draft_head
    return Engine.load(args.model, ctx_size=args.ctx, device=args.device, **kw)


def select_prompts(args):
    prompts = list(load_suite(args.suite).prompts)
    if args.per_set:
        prompts = [p for s in ("A", "V", "R") for p in [q for q in prompts if q.set == s][:args.per_set]]
    return prompts[:args.max_prompts] if args.max_prompts else prompts


def run_prompt(eng: Engine, ids: list[int], budget: int, spec: SpecConfig | None, sync) -> tuple[dict, SpecStats]:
    eng.reset()                               # every arm prefills the same prompt from scratch
    gen = Generation()
    toks = list(eng.generate(ids, budget, gen=gen, spec=spec or SpecConfig()))
    sync()
    return {"gen_ids": toks, "finish_reason": gen.finish_reason, "timings": gen.stats.timings(),
            "spec": gen.spec.to_dict()}, gen.spec


def summarize(rows: list[dict], stats: dict, arms: list[str], specs: dict, eog: int) -> dict:
    """stats[(prompt id, arm)]: that run's SpecStats."""
    out = {}
    for s in SETS:
        sel = [r for r in rows if s == "all" or r["set"] == s]
        if not sel:
            continue
        per_arm = {}
        for arm in arms:
            merged = SpecStats()
            for r in sel:
                merged.merge(stats[r["id"], arm])
            t = [r[arm]["timings"] for r in sel]
            per_arm[arm] = {
                "tok_s_geomean": geomean([x["predicted_per_second"] for x in t]),
                "ms_per_round_geomean": geomean([x["predicted_ms"] / max(1, x["rounds"]) for x in t]),
                "speedup_vs_plain_geomean": geomean([r[arm]["timings"]["predicted_per_second"]
                                                     / max(1e-9, r["none"]["timings"]["predicted_per_second"])
                                                     for r in sel]) if "none" in arms else None,
                "equal_to_plain": sum(r[arm]["gen_ids"] == r["none"]["gen_ids"] for r in sel) if "none" in arms else None,
                "prompts": len(sel), "stats": merged.to_dict(),
            }
            per_arm[arm]["tokens_per_round"] = per_arm[arm]["stats"]["tokens_per_round"]
        if "none" in arms:      # the copy drafter at every output position of the plain run
            copy = SpecConfig("ngram", draft_max=specs.get("ngram", SpecConfig("ngram")).draft_max, gate=False)
            rep = SpecStats()
            for r in sel:
                plain = r["none"]
                gen = plain["gen_ids"] + ([eog] if plain["finish_reason"] == "stop" else [])
                rep.merge(replay(r["prompt_ids"], gen, copy, r["max_tokens"]).rounds)
            per_arm["copy_replayed_from_plain"] = {"tokens_per_round": rep.tokens_per_round, "stats": rep.to_dict()}
        out[s] = per_arm
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model")
    p.add_argument("--replot", default=None, help="only draw the PNG of a result JSON")
    p.add_argument("--draft-head", default=None, help="MTP sidecar GGUF (default: found next to the model)")
    p.add_argument("--device", default="auto")
    p.add_argument("-c", "--ctx", type=int, default=8192)
    p.add_argument("--arms", nargs="+", default=["none", "ngram", "mtp", "mtp,ngram"],
                   help="spec types, each optionally /nogate, /always (MTP every round) or /p<floor>; "
                        "'none' (plain) is the control")
    p.add_argument("--suite", default=None, help="suite file (default: the public suite)")
    p.add_argument("--max-prompts", type=int, default=0, help="first N prompts only")
    p.add_argument("--per-set", type=int, default=0, help="first N prompts of each set only")
    p.add_argument("--max-tokens", type=int, default=0, help="cap every prompt's token budget")
    p.add_argument("--scale", type=float, default=1.0, help="scale every prompt's token budget")
    p.add_argument("--raw", action="store_true", help="send the messages' text without a chat template")
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--mtp-depth", type=int, default=3)
    p.add_argument("--mtp-min-p", type=float, default=0.5)
    p.add_argument("--spec-p-min", type=float, default=None)
    p.add_argument("--no-gate", action="store_true", help="every arm verifies every draft")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results")
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    if not args.model:
        p.error("-m/--model is required")

    specs = dict(parse_arm(a, args) for a in args.arms)
    arms = list(specs)
    if "none" in arms:                        # the control first
        arms = ["none"] + [a for a in arms if a != "none"]
    t0 = time.perf_counter()
    eng = load_engine(args)
    load_s = time.perf_counter() - t0
    device = eng.cache.k.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    floor = bandwidth_floor(eng.model, device)
    tables = {}
    for arm in arms:                          # round costs: timed (or read from the cache) before any run
        kinds = SPEC_TYPES[specs[arm].spec_type]
        if kinds and (len(kinds) > 1 or specs[arm].switched() or (specs[arm].gate and specs[arm].p_min is None)):
            t = specs[arm].cost_table(eng)
            tables[arm] = {"ms": t.ms, "measured": t.measured, "measure_s": t.measure_s, "from_cache": t.from_cache,
                           "gate": specs[arm].make_gate(t).to_dict()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"spec_suite-{Path(args.model).stem}-{device.type}{'-' + args.tag if args.tag else ''}-{time.strftime('%Y%m%d-%H%M%S')}"
    eog = next(iter(eng.tokenizer.stop_ids), -1)
    exact_arms = [a for a in arms if a != "none" and not specs[a].fast]
    rows, stats = [], {}
    host_at_start = host_state(sys.argv)

    def result(complete: bool) -> dict:
        return {
            "what": "arena public suite through the Engine, per speculation arm", "complete": complete,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit(), "command": " ".join(sys.argv),
            "host": host_state(sys.argv) if complete else host_at_start, "host_at_start": host_at_start,
            "model": args.model, "draft_head": args.draft_head, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "load_s": load_s, "graph_capture_s": getattr(eng.model, "capture_s", None), "floor": floor,
            "arms": {a: {"spec_type": s.spec_type, "gate": s.gate, "p_min": s.p_min, "draft_max": s.draft_max,
                         "mtp_depth": s.mtp_depth, "mtp_min_p": s.mtp_min_p, "mtp_switch": s.switched(),
                         "mode": s.mode} for a, s in specs.items()},
            "round_costs": tables,
            "policy_learned": {a: [m.policy.to_dict() for m in specs[a].memory.models.values()]
                               for a in arms if a != "none"},
            "all_equal_to_plain": all(r[a]["gen_ids"] == r["none"]["gen_ids"] for r in rows for a in exact_arms)
            if "none" in arms else None,
            "summary": summarize(rows, stats, arms, specs, eog), "prompts": rows,
        }

    for item in select_prompts(args):
        text = "\n".join(m["content"] for m in item.messages)
        ids = eng.encode_prompt(text) if args.raw else eng.encode_chat(list(item.messages))
        budget = max(1, int(item.max_tokens * args.scale))
        if args.max_tokens:
            budget = min(budget, args.max_tokens)
        if len(ids) + budget + 65 > eng.ctx_size:
            print(f"{item.id}: {len(ids)} prompt tokens + {budget} do not fit {eng.ctx_size}; skipped", flush=True)
            continue
        rec = {"id": item.id, "set": item.set, "prompt_ids": ids, "max_tokens": budget}
        for arm in arms:
            rec[arm], stats[item.id, arm] = run_prompt(eng, ids, budget, specs[arm] if arm != "none" else None, sync)
        line = f"{item.id} {len(rec[arms[0]]['gen_ids']):4d} tok"
        for arm in arms:
            t = rec[arm]["timings"]
            same = "" if arm == "none" or "none" not in rec else (" =" if rec[arm]["gen_ids"] == rec["none"]["gen_ids"] else " DIFF")
            line += f" | {arm} {t['predicted_per_second']:7.1f} tok/s {rec[arm]['spec']['tokens_per_round']:5.2f} tok/rd{same}"
        print(line, flush=True)
        rows.append(rec)
        # written after every prompt: a run cut short by a time limit keeps what it measured
        (out_dir / f"{stem}.json").write_text(json.dumps(result(complete=False)))
    res = result(complete=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(res))
    try:
        plot(res, out_dir / f"{stem}.png")
    except ImportError as e:                  # a device without matplotlib: plot here later with --replot
        print(f"no plot ({e}); make it with: python bench/spec_suite.py --replot {stem}.json")
    print_table(res, arms)
    print(f"wrote {out_dir / stem}.json and .png; exact arms equal to plain on every prompt: {res['all_equal_to_plain']}")
    return 0 if res["all_equal_to_plain"] in (True, None) else 1


def bandwidth_floor(model, device) -> dict | None:
    """Plain decode's floor (DESIGN §8): the weight bytes one token reads over the measured
    device copy rate (KV bytes left out: they grow with the depth, ~1% of a 0.5B model's
    bytes at 1K tokens). None off the GPU."""
    nbytes = getattr(model, "weight_bytes", None)
    if device.type != "cuda" or not nbytes:
        return None
    bw = copy_bandwidth()
    return {"weight_bytes": nbytes, "copy_bandwidth_GBps": bw / 1e9, "floor_tok_s": bw / nbytes,
            "floor_ms_per_round": nbytes / bw * 1000}


def print_table(res: dict, arms: list[str]) -> None:
    print(f"{'set':4} {'arm':14} {'tok/s':>8} {'ms/rd':>7} {'tok/rd':>7} {'x plain':>7}  share of rounds")
    for s, per in res["summary"].items():
        for arm in arms:
            a = per[arm]
            share = ", ".join(f"{k} {v:.0%}" for k, v in a["stats"]["share_of_rounds"].items())
            x = a["speedup_vs_plain_geomean"]
            print(f"{s:4} {arm:14} {a['tok_s_geomean']:8.1f} {a['ms_per_round_geomean']:7.3f} "
                  f"{a['tokens_per_round']:7.2f} {x if x is None else round(x, 2)!s:>7}  {share}")
    if res.get("floor"):
        f = res["floor"]
        print(f"plain-decode floor: {f['weight_bytes'] / 1e6:.0f} MB a token at {f['copy_bandwidth_GBps']:.0f} GB/s = "
              f"{f['floor_tok_s']:.0f} tok/s ({f['floor_ms_per_round']:.3f} ms a round)")


def plot(res: dict, path: Path) -> None:
    """Both drafters' curves: conditional hit rate and chain survival per depth (MTP from
    the mtp arm, the copy from the ngram arm, each also inside the policy arm), MTP's
    calibration, and tokens per round per set and arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(15, 4))
    FigureCanvasAgg(fig)
    a1, a2, a3, a4 = fig.subplots(1, 4)
    allset = res["summary"].get("all", {})
    colour = {"mtp": "tab:green", "ngram": "tab:orange"}
    for arm, per in allset.items():
        if arm == "copy_replayed_from_plain":
            continue
        policy = len(SPEC_TYPES.get(res["arms"][arm]["spec_type"], ())) > 1
        for drafter, dc in per["stats"]["drafters"].items():
            ks = range(1, len(dc["conditional_hit_rate"]) + 1)
            kw = dict(color=colour.get(drafter), ls="--" if policy else "-", marker="o", ms=3,
                      label=f"{drafter} ({'inside the policy' if policy else 'alone'}, arm {arm})")
            a1.plot(ks, dc["conditional_hit_rate"], **kw)
            a2.plot(ks, dc["chain_survival"], **kw)
        if not policy:
            for drafter, cal in per["stats"]["calibration"].items():
                for d in cal:
                    a3.plot([b["predicted"] for b in d["bins"]], [b["observed"] for b in d["bins"]], marker="o", ms=3,
                            label=f"{drafter} depth {d['depth']} (n={d['n']})")
    a3.plot([0, 1], [0, 1], color="grey", lw=0.8)
    arms = [a for a in allset if a != "copy_replayed_from_plain"]
    sets = [s for s in SETS if s in res["summary"]]
    w = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        a4.bar([j + i * w for j in range(len(sets))], [res["summary"][s][arm]["tokens_per_round"] for s in sets],
               w, label=arm)
    a4.set_xticks([j + w * (len(arms) - 1) / 2 for j in range(len(sets))], sets)
    for a in (a1, a2):
        a.xaxis.get_major_locator().set_params(integer=True)
    a1.set(title="conditional hit rate", xlabel="draft depth k", ylim=(0, 1.05))
    a2.set(title="chain survival", xlabel="draft depth k", ylim=(0, 1.05))
    a3.set(title="MTP calibration", xlabel="draft probability (bin mean)", ylabel="accepted share", xlim=(0, 1), ylim=(0, 1.05))
    a4.set(title="tokens per round (exact mode)")
    for a in (a1, a3, a4):
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=6)
    fig.suptitle(f"{Path(str(res['model'])).name} on {res['gpu'] or res['device']}, arena public suite, commit {res['commit'][:7]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

"""Copy-drafter statistics from plain greedy runs (spec/replay.py), per set of the arena
suite: tokens per round, conditional hit rate and chain survival at each depth.

    python bench/spec_replay_stats.py RUN.json OUT_PREFIX

RUN.json: output of bench/gpu_qwen_suite.py (plain greedy token ids per prompt).
Writes OUT_PREFIX.json and OUT_PREFIX.png.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from alphallama.spec.config import SpecConfig
from alphallama.spec.replay import replay
from alphallama.spec.stats import SpecStats

SETTINGS = {"ngram_min2_max16": SpecConfig("ngram", 16, 2), "ngram_min3_max16": SpecConfig("ngram", 16, 3),
            "ngram_min2_max64": SpecConfig("ngram", 64, 2)}
EOG = 151645   # <|im_end|>: appended where the plain run ended on it


def position_curves(positions: list[dict], depth: int) -> dict:
    """Every output position as a round start: P(draft k confirmed | 1..k-1 confirmed)."""
    reached = [0] * depth
    hits = [0] * depth
    for p in positions:
        for k in range(min(p["proposed"], p["confirmed"] + 1, depth)):
            reached[k] += 1
            hits[k] += k < p["confirmed"]
    cond = [h / r if r else 0.0 for h, r in zip(hits, reached)]
    surv, s = [], 1.0
    for c in cond:
        s *= c
        surv.append(s)
    return {"reached": reached, "hits": hits, "conditional_hit_rate": cond, "chain_survival": surv,
            "positions": len(positions), "positions_with_draft": sum(p["proposed"] > 0 for p in positions)}


def main() -> int:
    run = json.loads(Path(sys.argv[1]).read_text())
    prefix = Path(sys.argv[2])
    out = {"source": sys.argv[1], "model": run.get("model"), "host": run.get("host", {}).get("gpu"), "settings": {}}
    for name, spec in SETTINGS.items():
        per_set: dict[str, SpecStats] = {}
        positions: dict[str, list[dict]] = {}
        per_prompt = {}
        for r in run["prompts"]:
            plain = r["plain"]
            gen = plain["gen_ids"] + ([EOG] if plain["finish_reason"] == "stop" else [])
            rep = replay(r["prompt_ids"], gen, spec, r["max_tokens"])
            for key in (r["set"], "all"):
                per_set.setdefault(key, SpecStats()).merge(rep.rounds)
                positions.setdefault(key, []).extend(rep.positions)
            per_prompt[r["id"]] = {"set": r["set"], "tokens": len(gen), "tokens_per_round": rep.rounds.tokens_per_round}
        out["settings"][name] = {
            "spec": spec.__dict__,
            "sets": {k: {"simulated": v.to_dict(), "every_position": position_curves(positions[k], spec.draft_max)}
                     for k, v in per_set.items()},
            "per_prompt": per_prompt,
        }
    Path(f"{prefix}.json").write_text(json.dumps(out, indent=1))
    plot(out, Path(f"{prefix}.png"))
    for name, s in out["settings"].items():
        print(name, {k: round(v["simulated"]["tokens_per_round"], 2) for k, v in s["sets"].items()})
    return 0


def plot(out: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    s = out["settings"]["ngram_min2_max16"]["sets"]
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    a1, a2, a3 = fig.subplots(1, 3)
    for key in ("A", "V", "R", "all"):
        if key not in s:
            continue
        ep = s[key]["every_position"]
        ks = range(1, len(ep["conditional_hit_rate"]) + 1)
        a1.plot(ks, ep["conditional_hit_rate"], marker="o", ms=3, label=key)
        a2.plot(ks, ep["chain_survival"], marker="o", ms=3, label=key)
    sets = [k for k in ("A", "V", "R", "all") if k in s]
    a3.bar(sets, [s[k]["simulated"]["tokens_per_round"] for k in sets])
    a1.set(title="conditional hit rate", xlabel="draft depth k", ylim=(0, 1.05))
    a2.set(title="chain survival", xlabel="draft depth k", ylim=(0, 1.05))
    a3.set(title="tokens per round (exact mode)")
    a1.legend()
    fig.suptitle(f"n-gram copy drafter (min 2, max 16) on {Path(str(out['model'])).name}, arena public suite")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

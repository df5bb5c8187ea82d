"""From samples to the arena's figures. Works on the JSON form of samples, so a
result file can be re-summarised later without rerunning anything.

Definitions (also printed in the report):
  basis       an arm's decode rate comes from the server's decode counter
              (`server_tps`) when every successful sample of that arm carried
              `timings`, else from the client clock (`client_tps`).
  mean        per prompt: arithmetic mean of the passes that succeeded.
  spread      per prompt: max/min - 1 over its passes; flagged when > threshold
              (default 10%): the passes disagree and the figure is suspect.
  geomean     per set (A, V, R, ...) and over all prompts ("all" is over prompts,
              not over set geomeans): geometric mean of the per-prompt means.
  Speed Index arm vs control per set: geometric mean, over the prompts both arms
              completed, of arm mean / control mean, on the server basis when both
              arms have it, else on the client clock for both. With no missing
              prompts this equals geomean(arm) / geomean(control).
tokens/round and ms/round are averaged over passes and reduced by geomean as well, so
per set geomean(tok/s) ≈ geomean(tokens/round) / geomean(ms/round) * 1000 whenever
every prompt reports rounds (exact when the passes of each prompt agree).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .suite import ordered_sets

ALL = "all"
DEFAULT_THRESHOLD = 0.10


def geomean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    if not vals or any(v <= 0 for v in vals):
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


@dataclass
class PromptFigures:
    set: str
    rate: list[float | None]            # per pass, on the arm's basis
    mean: float | None
    spread: float | None
    flagged: bool
    client: list[float | None]
    client_mean: float | None
    server: list[float | None]
    server_mean: float | None
    ttft_s: float | None
    tokens: list[int | None]
    tokens_differ: bool                 # greedy passes gave different lengths
    tokens_per_round: float | None
    ms_per_round: float | None
    acceptance: float | None
    ratio: float | None = None          # mean / control mean on the pair's basis
    errors: list[str] = field(default_factory=list)


@dataclass
class SetFigures:
    n: int                              # prompts with a mean
    geomean: float | None
    pass_geomeans: list[float | None]
    client_geomean: float | None
    server_geomean: float | None
    tokens_per_round: float | None
    ms_per_round: float | None
    ttft_s: float | None                # arithmetic mean of per-prompt means


def arm_basis(samples: list[dict[str, Any]]) -> str:
    ok = [s for s in samples if s["ok"]]
    return "server" if ok and all(s.get("server_tps") is not None for s in ok) else "client"


def summarize(samples: list[dict[str, Any]], prompts: list[dict[str, str]], arms: list[str],
              control: str, passes: int, threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """prompts: [{"id", "set"}] in suite order; samples: runner output (JSON form)."""
    by_arm = {a: [s for s in samples if s["arm"] == a] for a in arms}
    basis = {a: arm_basis(by_arm[a]) for a in arms}
    figures = {a: {p["id"]: _prompt_figures(p, by_arm[a], basis[a], passes, threshold)
                   for p in prompts} for a in arms}
    sets = ordered_sets(p["set"] for p in prompts)
    speed_index: dict[str, dict[str, Any]] = {}
    for a in arms:
        pair = "server" if basis[a] == basis[control] == "server" else "client"
        for pid, f in figures[a].items():
            f.ratio = _ratio(_pair_mean(f, pair), _pair_mean(figures[control][pid], pair))
        speed_index[a] = {s: {"si": geomean(f.ratio for f in _in_set(figures[a], s)),
                              "n": sum(f.ratio is not None for f in _in_set(figures[a], s)),
                              "basis": pair}
                          for s in sets + [ALL]}
    return {
        "control": control,
        "threshold": threshold,
        "passes": passes,
        "sets": sets,
        "arms": {a: {"basis": basis[a],
                     "prompts": {pid: asdict(f) for pid, f in figures[a].items()},
                     "sets": {s: asdict(_set_figures(list(_in_set(figures[a], s)), passes))
                              for s in sets + [ALL]}}
                 for a in arms},
        "speed_index": speed_index,
        "flags": [{"arm": a, "prompt": pid, "rate": f.rate, "spread": f.spread}
                  for a in arms for pid, f in figures[a].items() if f.flagged],
        "errors": [{"arm": s["arm"], "pass": s["pass"], "prompt": s["prompt"], "error": s["error"]}
                   for s in samples if not s["ok"]],
    }


def _pair_mean(f: PromptFigures, pair: str) -> float | None:
    return f.server_mean if pair == "server" else f.client_mean


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _in_set(figs: dict[str, PromptFigures], set_name: str) -> Iterable[PromptFigures]:
    return (f for f in figs.values() if set_name == ALL or f.set == set_name)


def _prompt_figures(prompt: dict[str, str], samples: list[dict[str, Any]], basis: str,
                    passes: int, threshold: float) -> PromptFigures:
    per_pass: list[dict[str, Any] | None] = []
    errors = []
    for k in range(1, passes + 1):
        found = [s for s in samples if s["prompt"] == prompt["id"] and s["pass"] == k]
        ok = [s for s in found if s["ok"]]
        per_pass.append(ok[0] if ok else None)
        errors += [f"pass {k}: {s['error']}" for s in found if not s["ok"]]
    done = [s for s in per_pass if s is not None]

    def col(key: str) -> list[Any]:
        return [s.get(key) if s else None for s in per_pass]

    rate = col("server_tps" if basis == "server" else "client_tps")
    present = [r for r in rate if r is not None]
    spread = max(present) / min(present) - 1 if len(present) >= 2 and min(present) > 0 else None
    tokens = col("tokens")
    return PromptFigures(
        set=prompt["set"], rate=rate, mean=mean(rate), spread=spread,
        # The epsilon keeps an exact 10% (44 vs 40 is 0.1000000000000001 in floats) unflagged.
        flagged=spread is not None and spread > threshold + 1e-9,
        client=col("client_tps"), client_mean=mean(col("client_tps")),
        server=col("server_tps"), server_mean=mean(col("server_tps")),
        ttft_s=mean(col("ttft_s")), tokens=tokens,
        tokens_differ=len({t for t in tokens if t is not None}) > 1,
        tokens_per_round=mean(s.get("tokens_per_round") for s in done),
        ms_per_round=mean(s.get("ms_per_round") for s in done),
        acceptance=mean(s.get("acceptance") for s in done),
        errors=errors)


def _set_figures(figs: list[PromptFigures], passes: int) -> SetFigures:
    return SetFigures(
        n=sum(f.mean is not None for f in figs),
        geomean=geomean(f.mean for f in figs),
        pass_geomeans=[geomean(f.rate[k] for f in figs) for k in range(passes)],
        client_geomean=geomean(f.client_mean for f in figs),
        server_geomean=geomean(f.server_mean for f in figs),
        tokens_per_round=geomean(f.tokens_per_round for f in figs),
        ms_per_round=geomean(f.ms_per_round for f in figs),
        ttft_s=mean(f.ttft_s for f in figs))

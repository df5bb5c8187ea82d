"""PNG plots of an arena result, drawn from the JSON document alone.

Figures are built with matplotlib's object API and the Agg canvas directly, so no
global backend or pyplot state is touched (the harness may run inside other code).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .stats import ALL

_HATCHES = ("", "//", "..", "xx")


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _colors(arms: list[str]) -> dict[str, Any]:
    return {a: f"C{i % 10}" for i, a in enumerate(arms)}


def plot_sets(doc: dict[str, Any], path: Path) -> Path | None:
    """Per-set geomean decode rate: one bar per arm and pass."""
    summary = doc["summary"]
    arms, sets, passes = [a["name"] for a in doc["arms"]], summary["sets"] + [ALL], summary["passes"]
    colors = _colors(arms)
    fig = Figure(figsize=(max(6.0, 1.6 * len(sets) * len(arms) * passes / 2), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / (len(arms) * passes)
    for i, arm in enumerate(arms):
        figs = summary["arms"][arm]
        for k in range(passes):
            x = [j + (i * passes + k) * width - 0.4 + width / 2 for j in range(len(sets))]
            y = [figs["sets"][s]["pass_geomeans"][k] or 0.0 for s in sets]
            ax.bar(x, y, width, color=colors[arm], hatch=_HATCHES[k % len(_HATCHES)],
                   edgecolor="black", linewidth=0.5, label=f"{arm} pass {k + 1} ({figs['basis']})")
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("decode tok/s (geomean)")
    ax.set_title("Decode rate per set, each pass")
    ax.legend(fontsize=7, ncols=max(1, len(arms)))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_ratios(doc: dict[str, Any], path: Path) -> Path | None:
    """Per-prompt mean rate of each arm over the control's; None with a single arm."""
    summary = doc["summary"]
    control = summary["control"]
    others = [a["name"] for a in doc["arms"] if a["name"] != control]
    if not others:
        return None
    prompts = [(p["id"], p["set"]) for p in doc["suite"]["prompts"]]
    colors = _colors([a["name"] for a in doc["arms"]])
    fig = Figure(figsize=(max(6.0, 0.35 * len(prompts) * len(others) + 2), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(others)
    for i, arm in enumerate(others):
        figs = summary["arms"][arm]["prompts"]
        x = [j + i * width - 0.4 + width / 2 for j in range(len(prompts))]
        ax.bar(x, [figs[pid]["ratio"] or 0.0 for pid, _ in prompts], width,
               color=colors[arm], label=f"{arm} / {control}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    for j in range(1, len(prompts)):   # separators between sets
        if prompts[j][1] != prompts[j - 1][1]:
            ax.axvline(j - 0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(prompts)), [pid for pid, _ in prompts], rotation=90, fontsize=7)
    ax.set_ylabel(f"decode rate / {control}")
    ax.set_title("Per-prompt ratio against the control (mean of passes)")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_rounds(doc: dict[str, Any], path: Path) -> Path | None:
    """Tokens per round against ms per round, one point per sample (DESIGN §8.3);
    dotted lines are constant tok/s. None when no server reported rounds."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in doc["samples"]:
        if s["ok"] and s.get("tokens_per_round") and s.get("ms_per_round"):
            points.setdefault(s["arm"], []).append((s["ms_per_round"], s["tokens_per_round"]))
    if not points:
        return None
    colors = _colors([a["name"] for a in doc["arms"]])
    fig = Figure(figsize=(6.0, 4.5))
    ax = fig.add_subplot()
    for arm, pts in points.items():
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, color=colors[arm], label=arm)
    xs = [p[0] for pts in points.values() for p in pts]
    ys = [p[1] for pts in points.values() for p in pts]
    x_max, y_max = max(xs) * 1.15, max(ys) * 1.15
    rates = sorted(y / x * 1000.0 for x, y in zip(xs, ys))
    for rate in {rates[0], rates[len(rates) // 2], rates[-1]}:
        x_end = min(x_max, y_max * 1000.0 / rate)   # where the line leaves the axes
        ax.plot([0, x_end], [0, rate * x_end / 1000.0], ":", color="grey", linewidth=0.8)
        ax.annotate(f"{rate:.0f} tok/s", (x_end, rate * x_end / 1000.0), fontsize=6,
                    color="grey", ha="right", va="top")
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, y_max)
    ax.set_xlabel("ms per round")
    ax.set_ylabel("tokens per round")
    ax.set_title("tok/s = tokens per round / ms per round")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


# Output file name -> plot; a plot returning None has nothing to show for this run.
PLOTS = {
    "plot-sets.png": plot_sets,
    "plot-ratios.png": plot_ratios,
    "plot-rounds.png": plot_rounds,
}


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    return [p for name, fn in PLOTS.items() if (p := fn(doc, out_dir / name)) is not None]

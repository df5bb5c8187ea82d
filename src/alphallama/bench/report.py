"""The arena's outputs: one JSON document with everything, and a Markdown report
rendered from that document alone (so an old result file can be re-rendered)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .stats import ALL

SCHEMA = "alphallama-arena/1"


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return path


def _f(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(doc: dict[str, Any], plots: list[str] | None = None) -> str:
    meta, summary = doc["meta"], doc["summary"]
    arms = [a["name"] for a in doc["arms"]]
    control = summary["control"]
    sets = summary["sets"] + [ALL]
    out = [f"# Arena run {meta['date']}", ""]
    out += _meta_lines(doc)
    out += ["", "## Per set", "",
            f"Decode tok/s: geometric mean over the set's prompts of the per-prompt mean of "
            f"{summary['passes']} pass(es). Basis `server` = the server's decode counter, "
            f"`client` = the client clock. Speed Index (SI) = geomean of per-prompt ratios "
            f"against the control arm `{control}` on a common basis.", ""]
    rows = []
    for a in arms:
        figs = summary["arms"][a]
        for s in sets:
            f, si = figs["sets"][s], summary["speed_index"][a][s]
            rows.append([a, s, figs["basis"], str(f["n"]), _f(f["geomean"]),
                         " / ".join(_f(v) for v in f["pass_geomeans"]),
                         _f(f["client_geomean"]), _f(si["si"], 3),
                         _f(f["tokens_per_round"], 2), _f(f["ms_per_round"], 2),
                         _f(f["ttft_s"], 1, 1000.0)])
    out += _table(["arm", "set", "basis", "n", "tok/s", "per pass", "client tok/s", "SI",
                   "tok/round", "ms/round", "TTFT ms"], rows)
    out += ["", "## Per prompt", "",
            "tok/s per pass: pass 1 / pass 2 / … (even passes ran the suite reversed); "
            f"⚠ = passes disagree by more than {summary['threshold']:.0%} (max/min − 1); "
            "≠ = the passes produced different token counts.", ""]
    rows = []
    for pid, pset in _prompt_order(doc):
        for a in arms:
            p = summary["arms"][a]["prompts"][pid]
            mark = ("⚠ " if p["flagged"] else "") + ("≠" if p["tokens_differ"] else "")
            rows.append([pid, pset, a, " / ".join(_f(v) for v in p["rate"]), _f(p["mean"]),
                         _f(p["ratio"], 3), _f(p["client_mean"]), _f(p["ttft_s"], 1, 1000.0),
                         " / ".join("—" if t is None else str(t) for t in p["tokens"]),
                         _f(p["tokens_per_round"], 2), _f(p["ms_per_round"], 2),
                         _f(p["acceptance"], 1, 100.0), mark.strip()])
    out += _table(["prompt", "set", "arm", "tok/s per pass", "mean", f"vs {control}",
                   "client tok/s", "TTFT ms", "tokens", "tok/round", "ms/round",
                   "accept %", "flags"], rows)
    out += _problem_lines(summary)
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


def _prompt_order(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["id"], p["set"]) for p in doc["suite"]["prompts"]]


def _meta_lines(doc: dict[str, Any]) -> list[str]:
    meta, settings = doc["meta"], doc["settings"]
    git = meta["git"]
    commit = git.get("commit") or "—"
    lines = [f"- command: `{meta['command']}`",
             f"- commit: `{commit}`{' (dirty)' if git.get('dirty') else ''}",
             f"- suite: `{doc['suite']['source']}` sha256 `{doc['suite']['sha256'][:12]}`, "
             f"{len(doc['suite']['prompts'])} prompts",
             f"- host: {meta['host']['cpu']}, {meta['host']['cpus']} CPUs, "
             f"{meta['host']['mem_gib']} GiB; torch {meta['versions'].get('torch')}",
             f"- settings: temperature {settings['temperature']}, "
             f"max_tokens × {settings['max_tokens_scale']}, passes {settings['passes']}, "
             f"order `{settings['order']}`"]
    for g in meta["gpu"].get("gpus", []):
        end = next((e for e in doc.get("gpu_end", {}).get("gpus", []) if e.get("index") == g.get("index")), {})
        lines.append(f"- GPU {g.get('index')}: {g.get('name')}, driver {g.get('driver')}, "
                     f"PCIe gen {g.get('pcie_gen')} x{g.get('pcie_width')}, "
                     f"SM {g.get('sm_clock_mhz')}/{g.get('sm_clock_max_mhz')} MHz at start, "
                     f"{end.get('sm_clock_mhz', '—')} MHz at end, {end.get('temperature_c', '—')} °C at end")
    if not meta["gpu"].get("gpus"):
        lines.append(f"- GPU: none ({meta['gpu'].get('note', '')})")
    for a in doc["arms"]:
        target = a["url"] or f"`{a['cmd']}`"
        lines.append(f"- arm **{a['name']}**{' (control)' if a['name'] == doc['summary']['control'] else ''}: "
                     f"{target}, model `{a.get('model', '—')}`")
    if doc.get("interrupted"):
        lines.append("- **interrupted**: partial results")
    return lines


def _problem_lines(summary: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if summary["flags"]:
        out += ["", "## Disagreeing passes", ""]
        out += [f"- {f['arm']} {f['prompt']}: " + " / ".join(_f(v) for v in f["rate"])
                + f" tok/s, spread {_f(f['spread'], 1, 100.0)}%" for f in summary["flags"]]
    if summary["errors"]:
        out += ["", "## Errors", ""]
        out += [f"- {e['arm']} pass {e['pass']} {e['prompt']}: {e['error']}" for e in summary["errors"]]
    return out

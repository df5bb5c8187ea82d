"""`alphallama bench`: run the arena protocol (DESIGN §8) against OpenAI-compatible
servers and write the JSON, Markdown and PNG results.

    alphallama bench --arm ours="alphallama serve -m M.gguf --port {port}" \\
                     --arm llama="llama-server -m M.gguf --port {port}" --control llama
    alphallama bench --arm vllm=http://127.0.0.1:8000 --sets A --prompts 2 \\
                     --max-tokens-scale 0.25

Request order: see schedule.py (two passes, the second reversed; a fresh server per
arm and pass for command arms; URL arms interleaved per prompt). Figures: client.py
(per request) and stats.py (means, agreement, geomeans, Speed Index).
Exit status: 0 all requests succeeded, 1 some failed (results still written),
2 bad arguments, 130 interrupted (partial results written).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import DEFAULTS
from . import hostinfo, plots, report, schedule
from .arms import ArmError, ArmSpec, parse_arm
from .runner import Runner, RunSettings, make_http
from .stats import DEFAULT_THRESHOLD, summarize
from .suite import Suite, SuiteError, load_suite, select


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--arm", action="append", required=True, metavar="NAME=URL|CMD",
                   help="a server to measure: a base URL (http://host:port) or a command "
                        "that starts one with a {port} placeholder; repeat for each arm")
    p.add_argument("--control", metavar="NAME", help="arm the Speed Index is against (default: the first)")
    p.add_argument("--suite", metavar="FILE.jsonl", help="prompt suite (default: the public suite)")
    p.add_argument("--sets", metavar="A,V,R", help="only these sets")
    p.add_argument("--prompts", metavar="IDS|N", help="only these ids (A01,R03) or the first N of each set")
    p.add_argument("--max-tokens-scale", type=float, default=1.0, metavar="X",
                   help="multiply every prompt's max_tokens (quick runs on CPU)")
    p.add_argument("--passes", type=int, default=2, help="passes; even ones run reversed (default 2)")
    p.add_argument("--temperature", type=float, default=DEFAULTS.sampling.temperature,
                   help="sampling temperature (default greedy)")
    p.add_argument("--seed", type=int, help="seed sent with every request")
    p.add_argument("--model", help="model name sent to every arm (default: each arm's first /v1/models id)")
    p.add_argument("--arm-model", action="append", default=[], metavar="ARM=MODEL",
                   help="model name for one arm (Ollama needs its tag)")
    p.add_argument("--extra-body", metavar="JSON", help="JSON object merged into every request body")
    p.add_argument("--no-usage", action="store_true",
                   help="do not send stream_options.include_usage (for servers that reject it)")
    p.add_argument("--warmup", type=int, default=0, help="untimed requests per server before measuring")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="abandon a request after S seconds without data (default 300)")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="a command arm's server must be healthy within S seconds")
    p.add_argument("--stop-timeout", type=float, default=15.0, metavar="S",
                   help="grace between SIGTERM and SIGKILL when stopping a server")
    p.add_argument("--flag-threshold", type=float, default=DEFAULT_THRESHOLD, metavar="F",
                   help="flag a prompt whose passes differ by more than F (default 0.10)")
    p.add_argument("--out", metavar="DIR", help="output folder (default bench/results/arena-<time>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ArmError(f"{what} {item!r}: expected NAME=VALUE")
        out[key.strip()] = value.strip()
    return out


def _prepare(args: argparse.Namespace) -> tuple[Suite, list[ArmSpec], str, RunSettings, Path]:
    """Check every argument before any server starts."""
    suite = select(load_suite(args.suite), [s.strip() for s in args.sets.split(",")] if args.sets else None,
                   args.prompts, args.max_tokens_scale)
    arms = [parse_arm(a) for a in args.arm]
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ArmError(f"arm names must be unique: {names}")
    control = args.control or names[0]
    if control not in names:
        raise ArmError(f"--control {control!r} is not an arm ({names})")
    arm_models = _pairs(args.arm_model, "--arm-model")
    if set(arm_models) - set(names):
        raise ArmError(f"--arm-model names unknown arm(s) {sorted(set(arm_models) - set(names))}")
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ArmError("--extra-body must be a JSON object")
    if args.passes < 1:
        raise ArmError("--passes must be at least 1")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("bench/results") / f"arena-{stamp}"
    settings = RunSettings(temperature=args.temperature, seed=args.seed,
                           include_usage=not args.no_usage, extra_body=extra, model=args.model,
                           arm_models=arm_models, read_timeout=args.timeout,
                           startup_timeout=args.startup_timeout, stop_timeout=args.stop_timeout,
                           warmup=args.warmup, log_dir=out / "logs")
    return suite, arms, control, settings, out


def run(args: argparse.Namespace) -> int:
    try:
        suite, arms, control, settings, out = _prepare(args)
    except (ArmError, SuiteError, ValueError, OSError) as e:
        print(f"alphallama bench: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    interleave = all(a.kind == "url" for a in arms)
    blocks = schedule.plan(tuple(a.name for a in arms), suite.prompts, args.passes, interleave)
    meta = hostinfo.host_state()
    interrupted = False
    with make_http(settings) as http, tqdm(total=sum(len(b.steps) for b in blocks), unit="req",
                                           disable=args.no_progress, file=sys.stderr,
                                           dynamic_ncols=True) as bar:
        runner = Runner(arms, settings, http, bar)
        try:
            runner.run(blocks)
        except KeyboardInterrupt:
            interrupted = True   # servers were stopped on the way out; keep what ran
    doc = _document(args, suite, runner, control, meta, interleave, interrupted)
    paths = _write(doc, out, plots_wanted=not args.no_plots)
    _print_summary(doc, paths)
    if interrupted:
        return 130
    return 1 if doc["summary"]["errors"] else 0


def _document(args: argparse.Namespace, suite: Suite, runner: Runner, control: str,
              meta: dict[str, Any], interleave: bool, interrupted: bool) -> dict[str, Any]:
    prompts = [{"id": p.id, "set": p.set, "category": p.category, "max_tokens": p.max_tokens}
               for p in suite.prompts]
    names = list(runner.arm_info)
    return {
        "schema": report.SCHEMA,
        "meta": meta,
        "gpu_end": hostinfo.gpu_state(),
        "interrupted": interrupted,
        "settings": {"temperature": args.temperature, "seed": args.seed, "passes": args.passes,
                     "max_tokens_scale": args.max_tokens_scale, "sets": args.sets,
                     "prompts": args.prompts, "extra_body": runner.settings.extra_body,
                     "include_usage": runner.settings.include_usage, "warmup": args.warmup,
                     "read_timeout_s": args.timeout, "flag_threshold": args.flag_threshold,
                     "order": "interleaved per prompt" if interleave else "block per arm and pass"},
        "suite": {"source": suite.source, "sha256": suite.sha256, "prompts": prompts},
        "arms": list(runner.arm_info.values()),
        "servers": runner.servers,
        "samples": runner.samples,
        "summary": summarize(runner.samples, prompts, names, control, args.passes, args.flag_threshold),
    }


def _write(doc: dict[str, Any], out: Path, plots_wanted: bool) -> list[Path]:
    pngs = plots.write_plots(doc, out) if plots_wanted else []
    doc["outputs"] = [p.name for p in pngs] + ["arena.json", "report.md"]
    paths = [report.write_json(doc, out / "arena.json")]
    md = out / "report.md"
    md.write_text(report.render_markdown(doc, [p.name for p in pngs]))
    return paths + [md] + pngs


def _print_summary(doc: dict[str, Any], paths: list[Path]) -> None:
    summary = doc["summary"]
    for arm in summary["arms"]:
        row = summary["arms"][arm]["sets"]
        cells = "  ".join(f"{s}={row[s]['geomean']:.1f}" if row[s]["geomean"] else f"{s}=—"
                          for s in row)
        si = summary["speed_index"][arm]["all"]["si"]
        print(f"{arm:>12} [{summary['arms'][arm]['basis']}] tok/s {cells}  SI "
              + (f"{si:.3f}" if si else "—"))
    if summary["flags"]:
        print(f"{len(summary['flags'])} prompt(s) with disagreeing passes")
    if summary["errors"]:
        print(f"{len(summary['errors'])} failed request(s); see the report")
    for p in paths:
        print(f"wrote {p}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alphallama bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

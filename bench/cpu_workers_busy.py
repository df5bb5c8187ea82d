"""The CPU expert workers when a cpu is not theirs alone: a post's latency with every worker's
cpu free ("quiet") and with a busy process pinned to one of the workers' cpus ("busy": a
desktop's other work, a VM's neighbours), for the library at --baseline (built from git) and
this tree's, in the same run. The tree's threads claim a phase's units one at a time and
move on when they are all done; before 4bbae0e each thread had one fixed share and a barrier
after each phase, so a post waited for the slowest share (baseline 4a8d267 for that pool).
Session 49, the device's host (15 workers, H100 machine): the claims were 2% faster at W = 1
quiet, 19% with a busy cpu, 13-25% at W = 4 (less time a post) (cpu_workers_busy-h100host-20261207-093038.json).

    PYTHONPATH=src python bench/cpu_workers_busy.py [--threads 2] [--posts 40] [--reps 4]
        [--widths 1 4] [--baseline REF] [--out bench/results]

The posts are cpu_workers_grouped.py's (one Qwen3-30B-A3B MoE layer, random planes, every
pair the CPU's), run by its --child (one pool a child process, posts timed REQ to DONE);
each case's outputs must hash alike across libraries and conditions (bit for bit).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from alphallama.bench.hostinfo import host_state
from alphallama.offload.native import build
from alphallama.offload.native.bench import build_at

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_workers_grouped import _median, placement  # noqa: E402


def run_child(so: str, a) -> dict:
    cmd = [sys.executable, str(HERE / "cpu_workers_grouped.py"), "--child", so, "--posts", str(a.posts),
           "--experts", str(a.experts), "--widths", *map(str, a.widths), "--threads", str(a.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def busy(cpu: int) -> subprocess.Popen:
    """A process spinning on `cpu` until killed."""
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--posts", type=int, default=40)
    ap.add_argument("--reps", type=int, default=4, help="children per library and condition")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--baseline", required=True, help="a git ref (or a folder of .c files): the other library")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    _, cpus, _ = placement(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"baseline": str(build_at(a.baseline, Path(tmp))), "tree": "tree"}
        build.lib()                                    # built once, before the children load it
        runs: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in libs} for c in ("quiet", "busy")}
        for cond in runs:
            spin = busy(cpus[0]) if cond == "busy" else None
            try:
                for rep in range(a.reps):              # alternate which goes first
                    for name in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
                        runs[cond][name].append(run_child(libs[name], a))
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
    rows = []
    for case in runs["quiet"]["tree"][0]:
        hashes = {r[case]["y"] for c in runs.values() for lib in c.values() for r in lib}
        row = {"case": case, "bit_exact": len(hashes) == 1}
        for cond, by_lib in runs.items():
            med = {n: _median([_median(r[case]["times"]) for r in rs]) * 1e6 for n, rs in by_lib.items()}
            row[cond] = {"baseline_us": round(med["baseline"], 1), "tree_us": round(med["tree"], 1),
                         "baseline_over_tree": round(med["baseline"] / med["tree"], 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    host = host_state(sys.argv)
    res = {**host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"], "baseline": a.baseline,
           "threads": a.threads, "cpus": cpus, "busy_cpu": cpus[0], "posts": a.posts, "reps": a.reps, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    path = Path(a.out) / f"cpu_workers_busy-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

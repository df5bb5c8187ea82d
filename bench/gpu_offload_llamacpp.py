"""llama.cpp's MoE offload at the budgets of bench/gpu_offload_v2.py (issue 34), same device call.

What: for the GGUF our offload arms run on (the 30B-A3B synthetic shape, --layers 12 by default)
and the same --fractions (100 / 50 / 25 / 10% of the expert bytes in VRAM), llama.cpp's own
offload at the same VRAM budget: `--n-cpu-moe N` keeps the expert tensors of the first N layers
in CPU RAM (common/arg.cpp: one override `blk\\.<i>\\.ffn_(up|down|gate|gate_up)_(ch|)exps` to the
CPU buffer type for i < N, common/common.h; llama-bench builds the same list,
tools/llama-bench/llama-bench.cpp). Per fraction we pick the smallest N whose experts left on the
GPU (the GGUF's bytes of the matching tensors of layers >= N) are not above the target:
  --basis bytes     (default) the expert bytes our budget allows (fraction x our device bytes of
                    all experts, offload/plan.model_sizes: what `--gpu-mem` gives the store),
  --basis fraction  the same fraction of the file's expert bytes,
  --basis both      both Ns (benched once each where they differ).
N = 0 is llama.cpp's resident control. Then `llama-bench -m F -ngl 99 -fa 1 --n-cpu-moe N
-p 512 -n 128 -r 3 -o json` per distinct N (or `-ot "blk\\.(0|1|..)\\.ffn_..._exps=CPU"` with
--use-ot, the same placement), over --threads (default: the physical cores, llama-bench's own
default on a non-hybrid x86 host, and every logical CPU) and --load-modes (auto, and none:
llama.cpp warns that CPU overrides run better without mmap); the best tg128 per fraction is
llama.cpp's figure. A short `-v -p 0 -n 1 -r 1` run per N reads llama.cpp's "model buffer size" lines, so the JSON holds its
actual CUDA0 bytes beside our computed placement (--no-check skips it).

Writes $OUT/gpu_offload_llamacpp-<stem>-<date>.json after every N (host: date, GPU name/driver
through nvidia-smi, git commit or $GIT_COMMIT, command; placement; rows) and prints a table.
--ours PATH (a gpu_offload_v2-*.json) adds ours / llama.cpp per fraction: tok/s over tg128 and
ms/round beside llama.cpp's ms/token. Ours decodes --tokens after a short prompt, tg128 starts
from an empty context: both are plain greedy decode at a short depth. --from-json PATH re-reads
an earlier result of this script (no bench) to print the table and ratios.

On the device (carry [".whl", ".devcarry"]), in the warm machine that ran
`bash bench/gpu_llamacpp.sh build` (llama-bench in /tmp/llama.cpp/build/bin), after
`python bench/gpu_offload_v2.py` (which writes /tmp/offload-v2-synth.gguf; this script writes it
too, with the same preset/quant/layers, when missing or when its layer count differs):
    python bench/gpu_offload_llamacpp.py                     # ~3-4 min at --layers 12 (estimate)
    python bench/gpu_offload_llamacpp.py --gguf F.gguf --fractions 1 0.5 0.25 0.1
$OUT is fresh in every call, so the ratios are usually made afterwards, here:
    python bench/gpu_offload_llamacpp.py --from-json gpu_offload_llamacpp-*.json --ours gpu_offload_v2-*.json
(or in the same call as v2: `... --ours $OUT/gpu_offload_v2-*.json`).
On the CPU (no llama.cpp needed): --dry-run prints the placement and the commands:
    PYTHONPATH=src python bench/gpu_offload_llamacpp.py --preset tiny-qwen3moe --layers 8 \\
        --gguf /tmp/tiny-moe.gguf --dry-run
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"   # common/common.h LLM_FFN_EXPS_REGEX
_BLK = re.compile(r"blk\.(\d+)\.")
_BUF = re.compile(r"^\S*:\s+(\S+) model buffer size =\s+([\d.]+) MiB", re.M)
_OURS_ROW = re.compile(r"^store, --gpu-mem for (\d+)% of experts$")
MiB = 1 << 20


# --- placement (pure; tests/bench/test_offload_llamacpp.py) ------------------------------------

def layer_expert_bytes(f) -> dict[int, int]:
    """Layer -> file bytes of the tensors llama.cpp's --n-cpu-moe moves (regex_search, as
    llama-model-loader.cpp matches overrides), from an open GGUFFile."""
    out: dict[int, int] = {}
    for name, t in f.tensors.items():
        m = _BLK.match(name)
        if m and re.search(EXPS_REGEX, name):
            out[int(m.group(1))] = out.get(int(m.group(1)), 0) + t.nbytes
    return out


def gpu_expert_bytes(layer_bytes: dict[int, int], n: int) -> int:
    """Expert bytes left on the GPU with --n-cpu-moe n (layers 0..n-1 to the CPU)."""
    return sum(b for layer, b in layer_bytes.items() if layer >= n)


def choose_n(layer_bytes: dict[int, int], n_layers: int, target: int) -> int:
    """The smallest N (the most experts on the GPU) with gpu_expert_bytes <= target."""
    for n in range(n_layers + 1):
        if gpu_expert_bytes(layer_bytes, n) <= target:
            return n
    return n_layers


def ot_regex(n: int) -> str | None:
    """The -ot value equal to --n-cpu-moe n (one alternation instead of n patterns)."""
    if n <= 0:
        return None
    return r"blk\.(" + "|".join(str(i) for i in range(n)) + r")" + EXPS_REGEX + "=CPU"


def placement(layer_bytes: dict[int, int], n_layers: int, fractions: list[float], ours_experts: int,
              basis: str) -> list[dict]:
    """One row per (fraction, basis): the target bytes, N, and what N leaves on the GPU."""
    total = sum(layer_bytes.values())
    rows = []
    for frac in fractions:
        for b in (("bytes", "fraction") if basis == "both" else (basis,)):
            target = int(frac * (ours_experts if b == "bytes" else total))
            n = 0 if frac >= 1 else choose_n(layer_bytes, n_layers, target)
            gpu = gpu_expert_bytes(layer_bytes, n)
            rows.append({"fraction": frac, "basis": b, "target_bytes": target, "n_cpu_moe": n,
                         "gpu_expert_bytes": gpu, "cpu_expert_bytes": total - gpu,
                         "gpu_expert_share": gpu / total if total else 1.0, "ot": ot_regex(n)})
    return rows


def bench_cmd(binary: str, gguf: str, n: int, threads: list[int], load_modes: list[str],
              reps: int, use_ot: bool, check: bool = False) -> list[str]:
    cmd = [binary, "-m", gguf, "-ngl", "99", "-fa", "1"]
    if n and use_ot:
        cmd += ["-ot", ot_regex(n)]
    elif n:
        cmd += ["--n-cpu-moe", str(n)]
    if threads:
        cmd += ["-t", ",".join(map(str, threads))]
    if load_modes and load_modes != ["auto"]:
        cmd += ["-lm", ",".join(load_modes)]
    return cmd + (["-p", "0", "-n", "1", "-r", "1", "-v", "-o", "json"] if check
                  else ["-p", "512", "-n", "128", "-r", str(reps), "-o", "json"])


def parse_buffers(log: str) -> dict[str, float]:
    """llama.cpp's `<name> model buffer size = X MiB` lines (llama-model.cpp), summed per name."""
    out: dict[str, float] = {}
    for name, mib in _BUF.findall(log):
        out[name] = out.get(name, 0.0) + float(mib)
    return out


def physical_cores() -> int:
    """common_cpu_get_num_physical_cores on Linux: distinct thread_siblings sets."""
    sib = {Path(p).read_text().strip() for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings")}
    return len(sib) or os.cpu_count() or 1


def thread_arms(spec: list[str]) -> list[int]:
    """'phys' (llama-bench's default -t: common_cpu_get_num_math, the physical cores on a
    non-hybrid x86 Linux host), 'all' (os.cpu_count()) or a number; deduplicated, in order."""
    out: list[int] = []
    for s in spec:
        v = physical_cores() if s == "phys" else (os.cpu_count() or 1) if s == "all" else int(s)
        if v not in out:
            out.append(v)
    return out


def summarize(results: list[dict]) -> list[dict]:
    """llama-bench JSON rows -> one row per (threads, load mode): pp512 and tg128 tok/s."""
    arms: dict[tuple, dict] = {}
    for r in results:
        a = arms.setdefault((r.get("n_threads"), r.get("load_mode")),
                            {"n_threads": r.get("n_threads"), "load_mode": r.get("load_mode")})
        kind = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        a[kind], a[kind + "_std"] = r["avg_ts"], r["stddev_ts"]
    return list(arms.values())


def ours_by_fraction(ours: dict) -> dict[float | str, dict]:
    out: dict[float | str, dict] = {}
    for r in ours.get("rows", []):
        m = _OURS_ROW.match(r.get("config", ""))
        if m and "error" not in r:
            out[int(m.group(1)) / 100] = r
        elif r.get("config") == "resident (no store)":
            out["resident"] = r
    return out


def ratios(place: list[dict], runs: dict[int, dict], ours: dict) -> list[dict]:
    """Per placement row: ours (gpu_offload_v2 at that fraction) against llama.cpp's best tg128
    at its N, and both resident controls."""
    mine = ours_by_fraction(ours)
    out = []
    for p in place + [{"fraction": "resident", "basis": "-", "n_cpu_moe": 0}]:
        arms = [a for a in runs.get(p["n_cpu_moe"], {}).get("arms", []) if a.get("tg128")]
        best = max(arms, key=lambda a: a["tg128"], default=None)
        o = mine.get(p["fraction"] if p["fraction"] == "resident" else round(p["fraction"], 2))
        row = {"fraction": p["fraction"], "basis": p["basis"], "n_cpu_moe": p["n_cpu_moe"],
               "ours_tok_s": o and o.get("tok_s"), "ours_ms_per_round": o and o.get("ms_per_round"),
               "ours_hit_rate": o and o.get("hit_rate", 1.0 if p["fraction"] in ("resident", 1.0) else None),
               "llama_tg128": best and best["tg128"], "llama_pp512": best and best.get("pp512"),
               "llama_best_arm": best and {"n_threads": best["n_threads"], "load_mode": best["load_mode"]}}
        row["llama_ms_per_token"] = row["llama_tg128"] and 1000 / row["llama_tg128"]
        row["ours_over_llama_tok_s"] = (row["ours_tok_s"] / row["llama_tg128"]
                                        if row["ours_tok_s"] and row["llama_tg128"] else None)
        out.append(row)
    return out


# --- the run ------------------------------------------------------------------------------------

def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0] or 0))


def print_tables(res: dict) -> None:
    print(f"{'frac':>5} {'basis':>8} {'target MiB':>10} {'N':>3} {'GPU exps MiB':>12} {'CUDA0 MiB':>9} "
          f"{'-t':>4} {'lm':>5} {'pp512':>9} {'tg128':>8} {'ms/tok':>7}")
    for p in res["placement"]:
        run = res["runs"].get(str(p["n_cpu_moe"]), res["runs"].get(p["n_cpu_moe"], {}))
        for a in run.get("arms") or [{}]:
            print(f"{p['fraction']:5.2f} {p['basis']:>8} {p['target_bytes'] / MiB:10.1f} {p['n_cpu_moe']:3} "
                  f"{p['gpu_expert_bytes'] / MiB:12.1f} {_fmt(run.get('buffers_mib', {}).get('CUDA0'), '9.1f')} "
                  f"{_fmt(a.get('n_threads'), '4')} {str(a.get('load_mode', '-')):>5} {_fmt(a.get('pp512'), '9.1f')} "
                  f"{_fmt(a.get('tg128'), '8.1f')} {_fmt(a.get('tg128') and 1000 / a['tg128'], '7.2f')}"
                  + (f"  {run['error']}" if run.get("error") else ""))
    if res.get("ratios"):
        print(f"\n{'frac':>8} {'basis':>8} {'N':>3} {'ours tok/s':>10} {'ms/round':>8} {'hit':>5} "
              f"{'llama tg128':>11} {'ms/tok':>7} {'ours/llama':>10}")
        for r in res["ratios"]:
            print(f"{str(r['fraction']):>8} {r['basis']:>8} {r['n_cpu_moe']:3} {_fmt(r['ours_tok_s'], '10.1f')} "
                  f"{_fmt(r['ours_ms_per_round'], '8.2f')} {_fmt(r['ours_hit_rate'], '5.2f')} "
                  f"{_fmt(r['llama_tg128'], '11.1f')} {_fmt(r['llama_ms_per_token'], '7.2f')} "
                  f"{_fmt(r['ours_over_llama_tok_s'], '10.2f')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default="/tmp/offload-v2-synth.gguf", help="written when missing (v2's file)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--fractions", type=float, nargs="*", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--basis", choices=("bytes", "fraction", "both"), default="bytes")
    ap.add_argument("--threads", nargs="*", default=["phys", "all"],
                    help="-t arms: phys (llama-bench's default) | all | N (deduplicated)")
    ap.add_argument("--load-modes", nargs="*", default=["auto", "none"], help="-lm arms for N > 0")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--use-ot", action="store_true", help="-ot regex instead of --n-cpu-moe")
    ap.add_argument("--no-check", action="store_true", help="skip the -v run reading llama.cpp's buffer sizes")
    ap.add_argument("--bin", default="/tmp/llama.cpp/build/bin")
    ap.add_argument("--budget-s", type=float, default=540, help="start no llama-bench past this many seconds")
    ap.add_argument("--ours", default=None, help="a gpu_offload_v2-*.json: add ours / llama.cpp per fraction")
    ap.add_argument("--from-json", default=None, help="re-read an earlier result of this script (no bench)")
    ap.add_argument("--dry-run", action="store_true", help="print the placement and the commands, run nothing")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        if args.ours:
            res["ratios"] = ratios(res["placement"], {int(k): v for k, v in res["runs"].items()},
                                   json.loads(Path(args.ours).read_text()))
        print_tables(res)
        return 0

    from alphallama.bench.hostinfo import host_state
    from alphallama.gguf.reader import GGUFFile
    from alphallama.gguf.writer import PRESETS, write_synthetic

    def n_layers_of(f) -> int:
        return int(f.metadata[f"{f.architecture}.block_count"])

    path = args.gguf
    f = GGUFFile(path) if os.path.exists(path) else None
    wrote = None
    if f is None or (path == ap.get_default("gguf") and (n_layers_of(f) != args.layers or
                                                          f.metadata.get("general.name") != args.preset)):
        f, t0 = None, time.perf_counter()   # drop the old mapping before the file is rewritten
        spec = PRESETS[args.preset](n_layers=args.layers, **({"quant": args.quant} if args.quant else {}))
        write_synthetic(spec, path)
        wrote = time.perf_counter() - t0
        f = GGUFFile(path)
    n_layers = n_layers_of(f)
    layer_bytes = layer_expert_bytes(f)
    try:    # our device bytes of all experts: what --gpu-mem's fraction is taken of in gpu_offload_v2
        from alphallama.offload.plan import make_plan
        s = make_plan(path, ctx=2048, gpu_mem=1 << 50).sizes
        ours_experts, ours_note = s.experts, "offload/plan.model_sizes device bytes"
    except Exception as e:   # a file our engine cannot plan: fall back to the file's bytes
        ours_experts, ours_note = sum(layer_bytes.values()), f"file bytes ({type(e).__name__}: {e})"
    place = placement(layer_bytes, n_layers, args.fractions, ours_experts, args.basis)
    threads = thread_arms(args.threads)
    binary = str(Path(args.bin) / "llama-bench")
    commit = os.environ.get("GIT_COMMIT")
    res = {"host": host_state(sys.argv), "commit": commit, "gguf": path, "gguf_bytes": os.path.getsize(path),
           "write_s": wrote, "n_layers": n_layers, "layer_expert_bytes": layer_bytes,
           "file_expert_bytes": sum(layer_bytes.values()), "ours_expert_bytes": ours_experts,
           "ours_expert_bytes_from": ours_note, "basis": args.basis, "threads": threads,
           "physical_cores": physical_cores(), "cpus": os.cpu_count(), "load_modes": args.load_modes,
           "placement": place, "runs": {}}
    res["commit"] = commit or (res["host"].get("git") or {}).get("commit")
    stem = Path(path).stem
    name = f"gpu_offload_llamacpp-{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out_dir = Path(os.environ.get("OUT", "."))
    ns = sorted({p["n_cpu_moe"] for p in place} | {0})
    print(f"{path}: {n_layers} layers, experts {res['file_expert_bytes'] / MiB:.1f} MiB in the file, "
          f"{ours_experts / MiB:.1f} MiB ours ({ours_note}); N to bench {ns}; -t arms {threads}", flush=True)

    def cmd_for(n: int, check: bool = False) -> list[str]:
        """The resident control and the buffer check (one model load, its sizes) take one arm."""
        one = check or not n
        return bench_cmd(binary, path, n, threads[:1] if one else threads,
                         args.load_modes[:1] if check else ["auto"] if not n else args.load_modes,
                         args.reps, args.use_ot, check)

    if args.dry_run:
        for p in place:
            print(f"fraction {p['fraction']:.2f} ({p['basis']}): target {p['target_bytes']} B, N = {p['n_cpu_moe']}, "
                  f"GPU experts {p['gpu_expert_bytes']} B ({100 * p['gpu_expert_share']:.1f}%), -ot {p['ot']}")
        for n in ns:
            print(shlex.join(cmd_for(n)))
            if not args.no_check:
                print(shlex.join(cmd_for(n, check=True)))
        return 0
    if not os.access(binary, os.X_OK):
        print(f"{binary} not found: run `bash bench/gpu_llamacpp.sh build` first (same warm machine)")
        return 2

    def save():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(json.dumps(res, indent=1, default=str))

    for n in ns:
        run: dict = {"n_cpu_moe": n, "command": shlex.join(cmd_for(n)),
                     "gpu_expert_bytes": gpu_expert_bytes(layer_bytes, n)}
        res["runs"][n] = run
        left = args.budget_s - (time.perf_counter() - t_start)
        if left < 20:
            run["error"] = "skipped: past --budget-s"
            continue
        try:
            if not args.no_check:
                p = subprocess.run(cmd_for(n, check=True), capture_output=True, text=True, timeout=min(120, left))
                run["buffers_mib"] = parse_buffers(p.stderr + p.stdout)
                left = args.budget_s - (time.perf_counter() - t_start)
            t0 = time.perf_counter()
            p = subprocess.run(cmd_for(n), capture_output=True, text=True, timeout=max(left, 10))
            run["wall_s"] = time.perf_counter() - t0
            if p.returncode:
                run["error"] = f"rc {p.returncode}: " + p.stderr[-800:]
            else:
                run["llama_bench"] = json.loads(p.stdout)
                run["arms"] = summarize(run["llama_bench"])
        except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
            run["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps({k: v for k, v in run.items() if k != "llama_bench"}), flush=True)
        save()
    if 0 in res["runs"] and res["runs"][0].get("buffers_mib"):   # the CUDA0 bytes each N moved off, measured
        base = res["runs"][0]["buffers_mib"].get("CUDA0", 0.0)
        for n, run in res["runs"].items():
            if run.get("buffers_mib"):
                run["cuda0_moved_mib"] = base - run["buffers_mib"].get("CUDA0", 0.0)
                run["expected_moved_mib"] = (res["file_expert_bytes"] - run["gpu_expert_bytes"]) / MiB
    if args.ours:
        res["ours"] = args.ours
        res["ratios"] = ratios(place, res["runs"], json.loads(Path(args.ours).read_text()))
    save()
    print_tables(res)
    print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offload through the user's path (issue 34): `alphallama serve --gpu-mem B` on the 30B-A3B
shape at budgets that fit 100 / 50 / 25 / 10% of the expert bytes, against the same server
with no budget (resident) and against llama-server on the same file with --n-cpu-moe N at
the same VRAM budget (N the smallest whose GPU expert bytes fit our expert budget), same run.

Each arm starts its server, waits for /health 200, sends one warm-up request of
--warm-tokens (the bank warms, the CPU share settles), scrapes /metrics, then sends
--requests streaming /v1/completions one after another (a single user: a prompt of
--prompt-tokens token ids of the model's normal tokens, a different one each, max_tokens
--tokens, temperature 0, ignore_eos), scrapes /metrics again and stops the server. Figures
per arm: decode tok/s (client clock and the server's), ms/round and tokens/round (our
`timings.rounds`), TTFT, and from the two scrapes the bank's hit rate, admissions and the
CPU workers' share over the timed requests; the plan's layout and expected tok/s at the
budget (offload/plan.py, the host's measured bandwidths) beside the measured figure.
Ratios: each of our arms over our resident arm and over llama-server at the same budget.
Writes $OUT/gpu_offload_serve-<stem>-<date>.json after every arm and prints a table.

Device (one call; carry [".whl", ".devcarry"]; llama.cpp built in the same warm machine by
`bash bench/gpu_llamacpp.sh build`; the file is written here unless --gguf names one):
    GIT_COMMIT=$(git rev-parse HEAD) PYTHONUNBUFFERED=1 python bench/gpu_offload_serve.py \\
        [--layers 12] [--fractions 1 0.5 0.25 0.1] [--tokens 128] [--requests 3]
CPU smoke (ours only, the plumbing: on a CPU the plan runs the reference model, no store):
    PYTHONPATH=src python bench/gpu_offload_serve.py --device cpu --preset tiny-qwen3moe \\
        --layers 2 --fractions 0.5 --tokens 4 --requests 1 --warm-tokens 2 --prompt-tokens 8 --ctx 256
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import httpx

from alphallama.bench.client import stream_chat
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.offload.host_probe import measure
from alphallama.offload.plan import make_plan

sys.path.insert(0, str(Path(__file__).parent))
from gpu_np_servers import COMPLETIONS, Server, body, free_port, gpu_of, num, prompt_ids  # noqa: E402
from gpu_offload_llamacpp import layer_expert_bytes, placement  # noqa: E402

EMBEDDED = Path(__file__).resolve().parents[1] / "src/alphallama/data/alphallama-embedded.gguf"


def scrape(root: str) -> dict[str, float]:
    """GET /metrics as {sample name: value}; {} where the server has none (llama-server
    answers 501 without --metrics)."""
    r = httpx.get(root + "/metrics", timeout=10.0)
    if r.status_code != 200:
        return {}
    out = {}
    for ln in r.text.splitlines():
        k, _, v = ln.rpartition(" ")
        if ln and not ln.startswith("#") and k:
            try:
                out[k] = float(v)
            except ValueError:
                continue
    return out


def store_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """The expert store's figures over the timed requests (None where the server has no store)."""
    def d(k: str) -> float | None:
        return after[k] - before.get(k, 0.0) if k in after else None
    looks, hits = d("alphallama_expert_lookups_total"), d("alphallama_expert_hits_total")
    return {"lookups": looks, "hits": hits, "hit_rate": hits / looks if looks else None,
            "admissions": d("alphallama_expert_admissions_total"),
            "cpu_share": after.get("alphallama_expert_cpu_share"),
            "tier_bytes": {t: after.get(f'alphallama_expert_tier_bytes{{tier="{t}"}}') for t in ("bank", "host", "mapped")},
            "cpu_clock": {k: d(f"alphallama_expert_cpu_{k}") for k in CLOCK}}


CLOCK = ("posts_total", "busy_seconds_total", "gap_seconds_total", "gaps_total", "pairs_total", "groups_total")


def round_parts(store: dict | None, rounds: int) -> dict | None:
    """The CPU workers' clock a decode round (pool.c): posts, pairs, distinct experts, the
    workers' busy ms (a post seen to its results out) and the gaps' ms (results out to the
    next post: the GPU's part between two posts); the rest of ms_per_round is before the
    first post and after the last (attention, routing, bank experts, sampling)."""
    c = (store or {}).get("cpu_clock") or {}
    if not rounds or c.get("posts_total") is None:
        return None
    per = lambda k, s=1.0: c[k] * s / rounds   # noqa: E731
    return {"posts": per("posts_total"), "pairs": per("pairs_total"), "groups": per("groups_total"),
            "busy_ms": per("busy_seconds_total", 1e3), "gap_ms": per("gap_seconds_total", 1e3),
            "gaps": per("gaps_total")}


def summarize(reqs: list[dict]) -> dict:
    """Means over the timed requests (each a stream_chat measurement as a dict)."""
    def mean(k: str) -> float | None:
        v = [r[k] for r in reqs if r.get(k) is not None]
        return sum(v) / len(v) if v else None
    return {k: mean(k) for k in ("client_tps", "server_tps_reported", "ms_per_round", "tokens_per_round", "ttft_s")} | {
        "tokens": sum(r.get("tokens") or 0 for r in reqs), "ok": all(r.get("ok") for r in reqs)}


def run_arm(name: str, cmd: list[str], root: str, log: Path, prompts: list[list[int]], warm: list[int], a) -> dict:
    res: dict = {"arm": name, "cmd": shlex.join(cmd), "log": log.name}
    srv = Server(cmd, log, root)
    t0 = time.perf_counter()
    srv.start()
    try:
        srv.wait_healthy(a.timeout)
        res["start_s"] = time.perf_counter() - t0
        extra = {"ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(a.timeout, connect=10.0)) as http:
            w = stream_chat(http, root, body(warm, a.warm_tokens, extra), path=COMPLETIONS)
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}; log tail:\n{srv.tail()}")
            before = scrape(root)
            reqs = []
            for p in prompts:
                m = stream_chat(http, root, body(p, a.tokens, extra), path=COMPLETIONS)
                reqs.append({k: getattr(m, k) for k in ("ok", "error", "tokens", "client_tps", "server_tps_reported",
                                                         "ms_per_round", "tokens_per_round", "rounds", "ttft_s",
                                                         "e2e_s", "prompt_tokens")})
            after = scrape(root) if name.startswith("ours") else {}
        res.update(requests=reqs, summary=summarize(reqs), store=store_delta(before, after) if after else None)
        res["round_parts"] = round_parts(res["store"], sum(r.get("rounds") or 0 for r in reqs))
        errors = [r["error"] for r in reqs if r["error"]]
        if errors:
            res["error"] = f"{len(errors)} request(s) failed: {errors[0]}"
    except (RuntimeError, httpx.HTTPError) as e:
        res["error"] = str(e)
    finally:
        res["stop_rc"] = srv.stop(a.stop_timeout)
    return res


def ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x and y else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="the model (default: write the --preset shape here)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--warm-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ours-args", default="", help="more flags for alphallama serve (one string)")
    ap.add_argument("--llama-server", default="/tmp/llama.cpp/build/bin/llama-server")
    ap.add_argument("--llama-args", default="", help="more flags for llama-server (one string)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--stop-timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=34)
    a = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = a.gguf or f"/tmp/offload-serve-{a.preset}-{a.layers}.gguf"
    if not a.gguf:
        write_synthetic(PRESETS[a.preset](n_layers=a.layers, vocab_from=str(EMBEDDED)), path)
    stem = Path(path).stem
    name = out_dir / f"gpu_offload_serve-{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    host = host_state(sys.argv)
    bw = measure(path, cache=False)
    sizes = make_plan(path, ctx=a.ctx, gpu_mem=1 << 50).sizes
    fixed = sizes.dense + sizes.kv + sizes.workspace
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": gpu_of(host),
           "commit": os.environ.get("GIT_COMMIT") or (host.get("git") or {}).get("commit"),
           "command": shlex.join([sys.executable, *sys.argv]), "gguf": path, "args": vars(a), "host": host,
           "bandwidths": bw.to_dict(), "sizes": sizes.__dict__, "notes": [], "arms": []}
    save = lambda: name.write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    prompts = prompt_ids(path, a.requests + 1, a.prompt_tokens, a.seed)
    warm, prompts = prompts[-1], prompts[:-1]
    f = GGUFFile(path)
    n_layers = int(f.metadata[f"{f.metadata['general.architecture']}.block_count"])
    place = {p["fraction"]: p for p in placement(layer_expert_bytes(f), n_layers, a.fractions, sizes.experts, "bytes")}
    llama = os.access(a.llama_server, os.X_OK)
    if not llama:
        res["notes"].append(f"llama-server arms skipped: {a.llama_server} not found (bash bench/gpu_llamacpp.sh build)")
    arms: list[tuple[str, float | None, list[str]]] = [("ours resident", None, [])]
    for frac in a.fractions:
        gpu_mem = fixed + int(frac * sizes.experts) + (1 << 20)
        arms.append((f"ours {int(100 * frac)}%", frac, ["--gpu-mem", str(gpu_mem)]))
    if llama:
        arms += [(f"llama-server {int(100 * frac)}%", frac, ["--n-cpu-moe", str(place[frac]["n_cpu_moe"])])
                 for frac in a.fractions]
    for arm, frac, flags in arms:
        port = free_port()
        root = f"http://127.0.0.1:{port}"
        if arm.startswith("ours"):
            cmd = [sys.executable, "-m", "alphallama.cli", "serve", "-m", path, "--host", "127.0.0.1", "--port",
                   str(port), "-c", str(a.ctx), "--device", a.device, *flags, *shlex.split(a.ours_args)]
        else:
            cmd = [a.llama_server, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-ngl", "99", "-fa", "on",
                   "-c", str(a.ctx), *flags, *shlex.split(a.llama_args)]
        print(f"[{arm}] {shlex.join(cmd)}", flush=True)
        r = run_arm(arm, cmd, root, out_dir / f"offload-serve-{arm.replace(' ', '-').replace('%', '')}.log",
                    prompts, warm, a)
        r["fraction"] = frac
        if arm.startswith("ours") and frac is not None:
            plan = make_plan(path, ctx=a.ctx, gpu_mem=int(flags[1]), bandwidths=bw)
            r["plan"] = {"layout": plan.layout, "slots": plan.slots,
                         "expected": plan.estimate.to_dict() if plan.estimate else None}
        elif not arm.startswith("ours"):
            r["placement"] = place[frac]
        if "error" in r:
            print(f"[{arm}] error: {r['error'][:300]}", flush=True)
        res["arms"].append(r)
        save()
    by = {r["arm"]: r for r in res["arms"]}
    base = ((by.get("ours resident") or {}).get("summary") or {}).get("client_tps")
    for r in res["arms"]:
        s = r.get("summary") or {}
        theirs = ((by.get(f"llama-server {int(100 * r['fraction'])}%") or {}).get("summary") or {}).get("client_tps") \
            if r["arm"].startswith("ours") and r["fraction"] is not None else None
        r["of_resident"], r["over_llama_server"] = ratio(s.get("client_tps"), base), ratio(s.get("client_tps"), theirs)
    save()

    print(f"\n{'arm':18} {'tok/s':>7} {'server':>7} {'ms/round':>8} {'tok/rnd':>7} {'hit':>5} {'share':>5} "
          f"{'expected':>8} {'of res':>6} {'/llama':>6}  error")
    for r in res["arms"]:
        s, st = r.get("summary") or {}, r.get("store") or {}
        exp = (((r.get("plan") or {}).get("expected")) or {}).get("tok_s")
        print(f"{r['arm']:18} {num(s.get('client_tps'), 7)} {num(s.get('server_tps_reported'), 7)} "
              f"{num(s.get('ms_per_round'), 8, 3)} {num(s.get('tokens_per_round'), 7, 2)} {num(st.get('hit_rate'), 5, 2)} "
              f"{num(st.get('cpu_share'), 5, 2)} {num(exp, 8)} {num(r.get('of_resident'), 6, 3)} "
              f"{num(r.get('over_llama_server'), 6, 2)}  {(r.get('error') or '').splitlines()[0][:50] if r.get('error') else ''}")
    print("\nthe CPU workers a round (pool.c's clock): posts, groups, busy ms, gap ms")
    for r in res["arms"]:
        if r.get("round_parts"):
            p = r["round_parts"]
            print(f"{r['arm']:18} {p['posts']:6.2f} {p['groups']:7.2f} {p['busy_ms']:8.3f} {p['gap_ms']:8.3f}")
    print(f"wrote {name}")
    return 0 if all("error" not in r for r in res["arms"]) else 1


if __name__ == "__main__":
    sys.exit(main())

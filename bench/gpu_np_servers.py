"""Parallel streams through the servers (issue 33's last figure): ours (`alphallama serve
-np N`) against llama-server (`-np N`) on the same GGUF, same run. For each server and each
N it starts the server with N slots of --ctx-per-slot tokens, waits for /health 200, warms it
with one request, sends N concurrent streaming /v1/completions (a prompt of --prompt-tokens
token ids, seeded random normal tokens, a different one per stream; max_tokens --tokens,
temperature 0, "ignore_eos": true for both servers: every stream makes --tokens tokens; the
tokens actually received are recorded), then stops it (SIGTERM to its process group, SIGKILL after
--stop-timeout). Writes $OUT/gpu_np_servers-<stem>-<date>.json and prints a table.

Figures, per stream: TTFT (request sent -> first text chunk), decode tok/s (tokens after the
first over the time after the first, client clock), tokens (usage, else timings.predicted_n,
else chunks), the server's own predicted_per_second. Per (server, N): total tok/s (all
tokens / the batch's wall time, first send to last end) and window tok/s (the tokens that
arrived while all N streams were decoding, from the last stream's first chunk to the first
stream's last chunk, over that window; a chunk counts as tokens/chunks of its stream).
Ratios ours / llama-server at each N.

Device (one call; carry [".whl", ".devcarry"]; the llama.cpp build in the same warm machine):
    bash bench/gpu_llamacpp.sh build      # once per warm machine (an earlier call)
    python3 -m alphallama synth --preset qwen3-8b --vocab-from src/alphallama/data/alphallama-embedded.gguf \\
        -o /path/F.gguf                   # a real vocabulary: the default padded one streams no text
    GIT_COMMIT=$(git rev-parse HEAD) PYTHONUNBUFFERED=1 python bench/gpu_np_servers.py \\
        --gguf /path/F.gguf [--ns 1 2 4] [--tokens 128] [--prompt-tokens 512] [--ctx-per-slot 2048] \\
        [--ours-args "--spec-type none"]
Ours runs with its serve defaults (on a GPU: the copy drafter, --spec-type auto) unless
--ours-args says otherwise; llama-server runs without speculation. Server logs go to
$OUT/np-<server>-N<n>.log.

CPU smoke (ours only; the embedded model; no llama-server here):
    PYTHONPATH=src python bench/gpu_np_servers.py --device cpu --ns 1 2 --tokens 8 \\
        --prompt-tokens 16 --ctx-per-slot 256
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from alphallama.bench.client import stream_chat
from alphallama.bench.hostinfo import host_state

COMPLETIONS = "/v1/completions"


def prompt_ids(gguf: str, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids drawn from the model's normal tokens (type 1)."""
    from alphallama.gguf.reader import GGUFFile
    meta = GGUFFile(gguf).metadata
    types = meta.get("tokenizer.ggml.token_type")
    vocab = len(meta["tokenizer.ggml.tokens"])
    normal = [i for i, t in enumerate(types or ()) if t == 1] or list(range(vocab))
    rng = random.Random(seed)
    return [[rng.choice(normal) for _ in range(length)] for _ in range(n)]


def texts_possible(gguf: str) -> str | None:
    """Why a model cannot stream text (the figures time text chunks), or None. A synthetic
    file's default byte vocabulary is 258 tokens padded with UNUSED [PAD] tokens, and its
    random weights pick those: both servers then stream no text at all (2026-12-06, H100)."""
    from alphallama.gguf.reader import GGUFFile
    types = GGUFFile(gguf).metadata.get("tokenizer.ggml.token_type") or []
    if types and sum(t == 1 for t in types) < 0.5 * len(types):
        return (f"{gguf}: {sum(t == 1 for t in types)} of {len(types)} tokens are normal tokens: its greedy "
                f"output is unused tokens, no text. Write the synthetic file with a real vocabulary: "
                f"python -m alphallama synth --preset P --vocab-from src/alphallama/data/alphallama-embedded.gguf")
    return None


def num(x, width: int, digits: int = 1) -> str:
    """A table cell: x in `width` columns, "-" where there is none."""
    return "-".rjust(width) if x is None else f"{x:{width}.{digits}f}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in its own process group, its output in `log`."""

    def __init__(self, cmd: list[str], log: Path, root: str):
        self.cmd, self.log, self.root = cmd, log, root
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        """Until GET /health is 200; RuntimeError (with the log's tail) if the process exits or time runs out."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health was 200; "
                                   f"log tail:\n{self.tail()}")
            try:
                if httpx.get(self.root + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"/health not 200 within {timeout:.0f} s; log tail:\n{self.tail()}")

    def stop(self, timeout: float) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(timeout)
        except ProcessLookupError:
            return self.proc.wait(timeout)


def body(prompt: list[int], tokens: int, extra: dict) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def stream_one(http: httpx.Client, root: str, req: dict, start: threading.Barrier, t0: float) -> dict:
    """One stream, sent when every stream of the batch is ready; times relative to t0."""
    times: list[float] = []
    start.wait()
    t_sent = time.perf_counter()
    m = stream_chat(http, root, req, path=COMPLETIONS, on_chunk=times.append)
    return {"ok": m.ok, "error": m.error, "tokens": m.tokens, "token_source": m.token_source,
            "chunks": m.chunks, "prompt_tokens": m.prompt_tokens, "finish_reason": m.finish_reason,
            "ttft_s": m.ttft_s, "decode_tok_s": m.client_tps, "server_tok_s": m.server_tps_reported,
            "server_prompt_tok_s": m.prefill_tps, "e2e_s": m.e2e_s,
            "t_sent": t_sent - t0, "times": [t - t0 for t in times]}


def aggregate(streams: list[dict]) -> dict:
    """The batch's figures from its streams (each: tokens, t_sent, e2e_s, times of its text
    chunks, all relative to one clock). Pure: tests/bench/test_np_servers.py."""
    done = [s for s in streams if s.get("tokens") and s.get("times")]
    out = {"streams_ok": sum(bool(s.get("ok")) for s in streams),
           "tokens": sum(s.get("tokens") or 0 for s in streams)}
    ends = [s["t_sent"] + s["e2e_s"] for s in streams if s.get("e2e_s") is not None]
    wall = max(ends) - min(s["t_sent"] for s in streams) if ends else 0.0
    out["wall_s"] = wall
    out["total_tok_s"] = out["tokens"] / wall if wall > 0 else None
    rates = [s["decode_tok_s"] for s in streams if s.get("decode_tok_s")]
    out["per_stream_decode_tok_s"] = sum(rates) / len(rates) if rates else None
    out["min_stream_decode_tok_s"] = min(rates) if rates else None
    ttfts = [s["ttft_s"] for s in streams if s.get("ttft_s") is not None]
    out["mean_ttft_s"] = sum(ttfts) / len(ttfts) if ttfts else None
    out["max_ttft_s"] = max(ttfts) if ttfts else None
    out["window_s"] = out["window_tok_s"] = None
    if len(done) == len(streams) and done:
        w0 = max(s["times"][0] for s in done)
        w1 = min(s["times"][-1] for s in done)
        if w1 > w0:
            n = sum(sum(w0 < t <= w1 for t in s["times"]) * s["tokens"] / len(s["times"]) for s in done)
            out["window_s"], out["window_tok_s"] = w1 - w0, n / (w1 - w0)
    return out


def ratios(ours: dict | None, theirs: dict | None) -> dict:
    keys = ("total_tok_s", "window_tok_s", "per_stream_decode_tok_s", "mean_ttft_s")
    a, b = (ours or {}).get("aggregate") or {}, (theirs or {}).get("aggregate") or {}
    return {k: (a[k] / b[k] if a.get(k) and b.get(k) else None) for k in keys}


def run_arm(name: str, cmd: list[str], root: str, log: Path, prompts: list[list[int]], warm: list[int],
            args, extra: dict) -> dict:
    res: dict = {"server": name, "N": len(prompts), "cmd": shlex.join(cmd), "log": log.name}
    srv = Server(cmd, log, root)
    t0 = time.perf_counter()
    srv.start()
    try:
        srv.wait_healthy(args.timeout)
        res["start_s"] = time.perf_counter() - t0
        limits = httpx.Limits(max_connections=len(prompts) + 2)
        with httpx.Client(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits) as http:
            w = stream_chat(http, root, body(warm, min(8, args.tokens), extra), path=COMPLETIONS)
            res["warmup"] = {"ok": w.ok, "error": w.error, "tokens": w.tokens, "e2e_s": w.e2e_s}
            if not w.ok:
                raise RuntimeError(f"warm-up request failed: {w.error}; log tail:\n{srv.tail()}")
            barrier = threading.Barrier(len(prompts))
            out: list[dict | None] = [None] * len(prompts)
            tz = time.perf_counter()

            def go(i: int) -> None:
                out[i] = stream_one(http, root, body(prompts[i], args.tokens, extra), barrier, tz)
            threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        res["aggregate"] = aggregate(out)
        res["streams"] = [{k: v for k, v in s.items() if k != "times"} for s in out]
        errors = [s["error"] for s in out if s["error"]]
        if errors:
            res["error"] = f"{len(errors)} stream(s) failed: {errors[0]}"
    except RuntimeError as e:
        res["error"] = str(e)
    finally:
        res["stop_rc"] = srv.stop(args.stop_timeout)
    return res


def gpu_of(host: dict) -> dict:
    g = (host.get("gpu") or {}).get("gpus") or []
    return {"name": g[0].get("name"), "driver": g[0].get("driver")} if g else {"name": None, "driver": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="the model (default: the embedded one)")
    ap.add_argument("--llama-server", default="/tmp/llama.cpp/build/bin/llama-server")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=128, help="max_tokens of each stream")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="ours' --device")
    ap.add_argument("--timeout", type=float, default=300.0, help="s: a server's start, a request's read")
    ap.add_argument("--stop-timeout", type=float, default=30.0)
    ap.add_argument("--ours-args", default="", help="more flags for alphallama serve (one string)")
    ap.add_argument("--llama-args", default="", help="more flags for llama-server (one string)")
    ap.add_argument("--seed", type=int, default=33)
    args = ap.parse_args()
    from alphallama.cli_run import resolve_model
    gguf = os.path.abspath(resolve_model(args.gguf))
    stem = Path(gguf).stem
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    name = out_dir / f"gpu_np_servers-{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    host = host_state(sys.argv)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": gpu_of(host),
           "commit": os.environ.get("GIT_COMMIT") or (host.get("git") or {}).get("commit"),
           "command": shlex.join([sys.executable, *sys.argv]), "gguf": gguf, "args": vars(args),
           "host": host, "notes": [], "runs": []}
    save = lambda: name.write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    why = texts_possible(gguf)
    if why:
        print(why, file=sys.stderr)
        return 2
    prompts = prompt_ids(gguf, max(args.ns) + 1, args.prompt_tokens, args.seed)
    warm, prompts = prompts[-1], prompts[:-1]
    servers = ["ours"]
    if os.access(args.llama_server, os.X_OK):
        servers.append("llama-server")
    else:
        res["notes"].append(f"llama-server arm skipped: {args.llama_server} not found (bash bench/gpu_llamacpp.sh build)")
        print(res["notes"][-1])
    for server in servers:
        for N in args.ns:
            port = free_port()
            ctx = N * args.ctx_per_slot
            if server == "ours":
                cmd = [sys.executable, "-m", "alphallama.cli", "serve", "-m", gguf, "--host", "127.0.0.1",
                       "--port", str(port), "-np", str(N), "-c", str(ctx), "--device", args.device,
                       *shlex.split(args.ours_args)]
            else:
                cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-ngl", "99",
                       "-fa", "on", "-np", str(N), "-c", str(ctx), *shlex.split(args.llama_args)]
            extra = {"ignore_eos": True}
            print(f"[{server} N={N}] {shlex.join(cmd)}", flush=True)
            r = run_arm(server, cmd, f"http://127.0.0.1:{port}", out_dir / f"np-{server}-N{N}.log",
                        prompts[:N], warm, args, extra)
            if "error" in r:
                print(f"[{server} N={N}] error: {r['error']}", flush=True)
            res["runs"].append(r)
            save()
    by = {(r["server"], r["N"]): r for r in res["runs"]}
    res["ratios_ours_over_llama"] = {str(N): ratios(by.get(("ours", N)), by.get(("llama-server", N)))
                                     for N in args.ns} if "llama-server" in servers else None
    save()
    print(f"\n{'server':13} {'N':>2} {'total tok/s':>11} {'window tok/s':>12} {'per-stream':>10} "
          f"{'min stream':>10} {'TTFT ms':>8} {'tokens':>12}  error")
    for r in res["runs"]:
        a = r.get("aggregate") or {}
        toks = "/".join(str(s["tokens"]) for s in r.get("streams", [])) or "-"
        ttft = a.get("mean_ttft_s")
        err = (r.get("error") or "").split("\n")[0][:60]
        print(f"{r['server']:13} {r['N']:>2} {num(a.get('total_tok_s'), 11)} {num(a.get('window_tok_s'), 12)} "
              f"{num(a.get('per_stream_decode_tok_s'), 10)} {num(a.get('min_stream_decode_tok_s'), 10)} "
              f"{num(ttft and ttft * 1e3, 8, 0)} {toks:>12}  {err}")
    if res["ratios_ours_over_llama"]:
        print(f"\nours / llama-server {'N':>2} {'total':>6} {'window':>7} {'per-stream':>10} {'TTFT':>6}")
        for N, q in res["ratios_ours_over_llama"].items():
            print(f"{'':19} {N:>2} {num(q['total_tok_s'], 6, 2)} {num(q['window_tok_s'], 7, 2)} "
                  f"{num(q['per_stream_decode_tok_s'], 10, 2)} {num(q['mean_ttft_s'], 6, 2)}")
    print(f"wrote {name}")
    return 0 if all("error" not in r for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

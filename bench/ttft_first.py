"""Is the first request as fast as later ones? TTFT of `alphallama serve`'s first requests.

Starts `alphallama serve` on a model (a synthetic Qwen3-8B-shaped Q4_K file written with
`alphallama synth --preset qwen3-8b` unless --model is given), waits for GET /health 200
(the load time), then streams, in order: a short prompt, another short one, a prompt of
more than one prefill chunk (512 tokens), another such prompt. Each prompt shares no
prefix with the others (a re-used prefix would hide the prefill). A warm-up at load
(warmup.py) should make request 1 as fast as 2 and request 3 as fast as 4; pass
`--serve-arg=--no-warmup` for the lazy baseline. Writes bench/results/ttft_first-<date>.json
($OUT/ on the device machine; date, GPU, driver, commit ($GIT_COMMIT where the tree has
no .git), command: alphallama.bench.hostinfo; each request's TTFT and the server's timings;
the load time and the server's load log) and prints a table.

    GIT_COMMIT=... python bench/ttft_first.py                         # the H200 run
    python bench/ttft_first.py --serve-arg=--no-warmup                # the baseline
    python bench/ttft_first.py --model src/alphallama/data/alphallama-embedded.gguf --device cpu   # CPU check
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from alphallama.bench.hostinfo import host_state
from alphallama.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "alphallama.cli"]
LONG_TOKENS = 600            # > one prefill chunk (512 rows): the chunk path's first long prompt
NEW_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_of(tok: Tokenizer, seed: str, n_tokens: int) -> str:
    """A text of about n_tokens tokens starting with `seed` (so no two prompts share a prefix)."""
    words, text = [], seed
    i = 0
    while len(tok.encode(text, add_special=True)) < n_tokens:
        words.extend(f"{seed}{j}" for j in range(i, i + 32))
        i += 32
        text = " ".join(words)
    while len(tok.encode(text, add_special=True)) > n_tokens and " " in text:
        text = text.rsplit(" ", 1)[0]
    return text


def stream_ttft(client: httpx.Client, base: str, prompt: str) -> dict:
    """One streamed completion: seconds to the first event that carries a token, and the total."""
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, timings, usage = None, None, None
    with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            timings = chunk.get("timings", timings)
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "usage": usage, "timings": timings}


def _extra(first: dict, second: dict) -> float | None:
    if first["ttft_s"] is None or second["ttft_s"] is None:
        return None
    return first["ttft_s"] - second["ttft_s"]


def start_server(args, model: str, port: int, log) -> tuple[subprocess.Popen, float]:
    cmd = [*CLI, "serve", "-m", model, "--port", str(port), "--host", "127.0.0.1", "--device", args.device,
           *args.serve_arg]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=log, stdout=log, text=True)
    while True:
        if proc.poll() is not None:
            log.flush()
            raise SystemExit(f"the server exited with {proc.returncode} before /health was 200; its log:\n"
                             + Path(log.name).read_text()[-4000:])
        if time.perf_counter() - t0 > args.load_timeout:
            proc.kill()
            raise SystemExit(f"the server was not healthy after {args.load_timeout} s")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (default: a synthetic --preset file)")
    p.add_argument("--preset", default="qwen3-8b", help="alphallama synth preset when no --model")
    p.add_argument("--layers", type=int, default=None, help="the synthetic model's layers (default: the preset's)")
    p.add_argument("--work-dir", default=None, help="where the synthetic model is written (default: a temp dir)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `alphallama serve` flag (repeatable)")
    p.add_argument("--load-timeout", type=float, default=900.0)
    p.add_argument("--out", default=None,
                   help="the JSON file (default: ttft_first-<date>.json in $OUT if set, else bench/results)")
    args = p.parse_args()
    env = host_state()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / f"synth-{args.preset}.gguf")
            t0 = time.perf_counter()
            layers = ["--layers", str(args.layers)] if args.layers else []
            subprocess.run([*CLI, "synth", "--preset", args.preset, "-o", model, *layers], check=True)
            print(f"wrote {model} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        tok = Tokenizer.from_gguf(model)
        prompts = [("short 1", prompt_of(tok, "apple", 24)), ("short 2", prompt_of(tok, "river", 24)),
                   ("long 1", prompt_of(tok, "stone", LONG_TOKENS)), ("long 2", prompt_of(tok, "cloud", LONG_TOKENS))]
        log_path = Path(tmp) / "serve.log"
        port = free_port()
        with open(log_path, "w") as log:
            proc, load_s = start_server(args, model, port, log)
        try:
            with httpx.Client(timeout=600) as client:
                rows = [{"request": name, **stream_ttft(client, f"http://127.0.0.1:{port}", text)}
                        for name, text in prompts]
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        load_log = log_path.read_text().splitlines()
    result = {**env, "commit": os.environ.get("GIT_COMMIT") or env["git"].get("commit"),
              "model": model if args.model else f"synth --preset {args.preset}"
                                                 + (f" --layers {args.layers}" if args.layers else ""),
              "serve_args": args.serve_arg, "load_s": load_s, "load_log": load_log, "requests": rows,
              # what the first request of each kind costs over the next one (the warm-up's goal: ~0)
              "first_extra_ttft_s": {"short": _extra(rows[0], rows[1]), "long": _extra(rows[2], rows[3])}}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or RESULTS) / f"ttft_first-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    gpu = (env["gpu"].get("gpus") or [{}])[0]
    print(f"{result['model']} on {gpu.get('name', 'cpu')} (driver {gpu.get('driver', '-')}), "
          f"serve {' '.join(args.serve_arg) or '(defaults)'}: healthy after {load_s:.1f} s")
    print(f"{'request':10} {'prompt':>7} {'reused':>7} {'TTFT s':>8} {'prefill ms':>11} {'total s':>8}")
    for r in rows:
        t, u = r["timings"] or {}, r["usage"] or {}
        print(f"{r['request']:10} {u.get('prompt_tokens', '-'):>7} {t.get('cache_n', '-'):>7} "
              f"{r['ttft_s'] or float('nan'):8.3f} {t.get('prompt_ms', float('nan')):11.1f} {r['total_s']:8.3f}")
    print("first over second TTFT: " + ", ".join(f"{k} {v:+.3f} s" for k, v in result["first_extra_ttft_s"].items()
                                                  if v is not None))
    print(f"wrote {out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

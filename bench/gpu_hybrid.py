"""The hybrids on the GPU runtime (runtime/gpu_hybrid.py; decisions/hybrid-gpu-runtime.md), one
device call: the Qwen3.6-35B-A3B-like shape (PRESETS["qwen36-35b-a3b"]: 16 key / 32 value heads of
128, attention every 4th layer, 256 experts of 512 + a shared one) cut to --layers layers and
--experts experts, Q4_K_M, written on the device, then (the rounds through CUDA graphs on a GPU)

- prefill: a 512-row prompt chunk (deltanet_prefill, the scratch's GEMMs, SDPA), ms;
- decode: rounds of W = 1 at increasing positions, ms a round;
- verify: rounds of W = 4 / 8 / 16 (the verify kernel) and the commit of n = 1 and n = W
  rows (the engine's truncate: one deltanet_commit for every recurrent layer), ms each;
- engine: 64 greedy tokens plain, with the n-gram drafter, the in-file MTP head
  (runtime/hybrid_mtp.py: min-p 0 and no switch, so the head's chain runs every round, its
  whole cost) and both (`mtp,ngram`: the policy, on the verify rounds' cost table timed once),
  in exact mode: tokens/s, and each run's tokens against plain's. Each arm after a warm-up
  (warmup.warm_up, what serve does at load): the cost table's timing and the head's first
  compiles otherwise land in the first speculative arm (session 42's "mtp" figure).

    PYTHONUNBUFFERED=1 python bench/gpu_hybrid.py [--layers 8] [--experts 32]
    TRITON_INTERPRET=1 python bench/gpu_hybrid.py --device cpu --preset tiny-qwen35moe --layers 2 \
        --experts 4 --mtp moe --prompt 70 --tokens 3 --reps 1 --widths 4 --repeat 4

(the second: a CPU smoke of the script). $OUT/gpu_hybrid-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from alphallama.bench.engine_bench import copy_bandwidth
from alphallama.bench.hostinfo import host_state
from alphallama.engine import Engine, Generation
from alphallama.gguf.arch import find_mtp_head, load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.runtime.gpu_hybrid import GPUHybridModel
from alphallama.spec.config import SpecConfig
from alphallama.spec.mtp import load_mtp_states
from alphallama.tokenizer import Tokenizer
from alphallama.warmup import WarmRun, warm_up


def _clock(device: torch.device):
    """() -> seconds, synchronizing the device first."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _toks(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def floor_bytes(f: GGUFFile, cache, depth: int) -> dict:
    """The bytes a W = 1 round must move at depth `depth`: every weight but the embedding's
    (routed experts: k of E), the recurrent states read and written, the attention layers' K/V."""
    cfg = load_config(f)
    share = cfg.n_experts_used / cfg.n_experts if cfg.n_experts else 1.0
    weights = sum(t.nbytes * (share if n.endswith("_exps.weight") else 1.0)
                  for n, t in f.tensors.items() if not n.startswith("token_embd"))
    states = 2 * cache.ssm.numel() * cache.ssm.element_size()                 # read + write
    kv_row = cache.k.shape[1] * cache.k.shape[3] * cache.k.element_size() * 2   # one position's K and V, one layer
    kv = kv_row * cache.k.shape[0] * depth
    return {"weights": int(weights), "states": states, "kv": kv, "total": int(weights) + states + kv}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen36-35b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32, help="routed experts kept (0: the preset's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--widths", default="4,8,16", help="verify widths")
    ap.add_argument("--repeat", type=int, default=16, help="the engine's prompt: a random stretch this long, 4 times")
    ap.add_argument("--mtp", default=None, choices=["dense", "moe", "none"],
                    help="the file's MTP block (default: the preset's; the 35B-A3B-like one has one)")
    ap.add_argument("--no-engine", action="store_true", help="the kernels' rounds and prefill only (no engine runs)")
    ap.add_argument("--file", default=None, help="the GGUF to write, or to reuse where it exists (kept: llama-bench reads it)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    now = _clock(dev)
    kw = {"n_layers": args.layers}
    if args.experts:
        kw["n_experts"] = args.experts
    if args.mtp is not None:
        kw["mtp"] = None if args.mtp == "none" else args.mtp
    spec = PRESETS[args.preset](**kw)
    out: dict = {**host_state(), "commit": os.environ.get("GIT_COMMIT") or _git_head(), "preset": args.preset, "layers": args.layers,
                 "experts": spec.n_experts, "device": str(dev)}
    if dev.type == "cuda":
        out["gpu_name"] = torch.cuda.get_device_properties(dev).name
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.file or Path(tmp) / "hybrid.gguf")
        t0 = time.perf_counter()
        if not (args.file and path.exists()):
            write_synthetic(spec, path)
        out["file_bytes"] = path.stat().st_size
        f = GGUFFile(path)
        ctx = args.prompt + args.tokens + 128
        gpu = GPUHybridModel(f, ctx, device=dev)
        out["load_s"] = time.perf_counter() - t0
        out["graphs"] = gpu.use_graphs
        V = gpu.cfg.vocab_size
        cache = gpu.new_cache(ctx)
        prompt = _toks(args.prompt, V, 0)
        out["capture_s"] = gpu.capture_s                                     # the graphs of this cache
        gpu.forward(prompt, 0, cache, logits=False)                           # compiles the prefill's kernels
        cache.truncate(0)
        t0 = now()
        gpu.forward(prompt, 0, cache, logits=False)
        out["prefill_ms"] = 1e3 * (now() - t0)
        out["prefill_delta_rule"] = gpu.delta_rule_name                       # fla's chunks or ours
        out["prefill_fla_failed"] = getattr(gpu.delta_rule, "failed", None)   # fla raised: ours ran
        if gpu.delta_rule is not None:                                        # ours beside it, same file
            rule, gpu.delta_rule = gpu.delta_rule, None
            for _ in range(2):
                cache.truncate(0)
                t0 = now()
                gpu.forward(prompt, 0, cache, logits=False)
            out["prefill_ms_our_rule"] = 1e3 * (now() - t0)
            gpu.delta_rule = rule
            cache.truncate(0)
            gpu.forward(prompt, 0, cache, logits=False)
        pos = args.prompt
        tok = _toks(1, V, 1)
        gpu.forward(tok, pos, cache)                                          # compiles the round's
        t0 = now()
        for i in range(args.reps):
            gpu.forward(tok, pos + 1 + i, cache)
        out["decode_w1_ms"] = 1e3 * (now() - t0) / args.reps
        out["decode_w1_tok_s"] = 1e3 / out["decode_w1_ms"]
        fb = floor_bytes(f, cache, cache.length)
        bw = copy_bandwidth() if dev.type == "cuda" else 1e9
        out["floor"] = {"bytes": fb, "copy_bandwidth_GBps": bw / 1e9, "ms": 1e3 * fb["total"] / bw,
                        "tok_s": bw / fb["total"], "share_of_floor_w1": 1e3 * fb["total"] / bw / out["decode_w1_ms"]}
        pos = cache.length
        cache.checkpoint()
        out["verify"] = {}
        for W in map(int, args.widths.split(",")):
            rows = _toks(W, V, W)
            gpu.verify(rows, pos, cache)                                      # warm (eager: compiles this width)
            cache.truncate(pos + 1)
            cache.truncate(pos)
            per: dict = {}
            for n in (1, W):
                tv = tc = 0.0
                for _ in range(args.reps):
                    t0 = now()
                    gpu.verify(rows, pos, cache)
                    t1 = now()
                    cache.truncate(pos + n)                                   # the commit
                    tc += now() - t1
                    tv += t1 - t0
                    cache.truncate(pos)                                       # the checkpoint's copies back
                per[f"verify_ms_n{n}"], per[f"commit_ms_n{n}"] = 1e3 * tv / args.reps, 1e3 * tc / args.reps
            out["verify"][W] = per
        if not args.no_engine:                                                # plain, ngram, mtp, mtp,ngram
            tokenizer = Tokenizer.from_metadata(f.metadata)
            head = find_mtp_head(f, gpu.cfg)
            t0 = time.perf_counter()
            mtp = load_mtp_states(*head, gpu, ctx, tokenizer) if head is not None else None
            engine = Engine(f, gpu, tokenizer, None, ctx, mtp=mtp)
            base = _toks(args.repeat, V, 2).tolist()
            prompt_ids = base * 4
            specs = {"plain": None, "ngram": SpecConfig("ngram", 16, 2, gate=False)}
            if mtp is not None:
                out["mtp_head"] = {"kind": type(engine.mtp.head).__name__, "load_s": time.perf_counter() - t0}
                tables = tempfile.mkdtemp(dir=tmp)        # the policy's cost table: timed once, for mtp,ngram
                for name in ("mtp", "mtp,ngram"):
                    specs[name] = SpecConfig(name, 16, 2, gate=False, mtp_min_p=0.0, mtp_switch=False,
                                             cost_cache_dir=tables)
            runs = {}
            for name, sc in specs.items():
                print(f"engine: {name}", file=sys.stderr, flush=True)
                t0 = time.perf_counter()       # what serve does at load: the cost table timed, graphs compiled
                warm_up(engine, sc if sc is not None else SpecConfig(), [WarmRun(len(prompt_ids))])
                warm_s = time.perf_counter() - t0
                engine.reset()
                g = Generation()
                toks = list(engine.generate(prompt_ids, args.tokens, gen=g, stop_ids=set(),
                                            **({"spec": sc} if sc is not None else {})))
                runs[name] = {"tokens": toks, "tok_s": 1e3 * len(toks) / g.stats.predicted_ms,    # after the prompt
                              "prompt_ms": g.stats.prompt_ms, "rounds": g.stats.rounds, "warm_up_s": warm_s,
                              "draft_n": g.stats.draft_n, "accepted": g.stats.draft_n_accepted}
            out["engine"] = {k: {x: y for x, y in v.items() if x != "tokens"} for k, v in runs.items()}
            out["engine"]["same_tokens"] = all(r["tokens"] == runs["plain"]["tokens"] for r in runs.values())
            for name, r in runs.items():
                out["engine"][name]["same_as_plain"] = r["tokens"] == runs["plain"]["tokens"]
            if mtp is not None:
                out["mtp_head"]["capture_s"] = mtp.head.capture_s
    print(json.dumps(out, indent=1, default=str))
    dest = Path(os.environ.get("OUT", "."))
    name = f"gpu_hybrid-{time.strftime('%Y%m%d-%H%M%S')}.json"
    (dest / name).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()

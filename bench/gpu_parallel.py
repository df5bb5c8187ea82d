"""Parallel streams (-np N) through the engine: aggregate and per-stream decode tok/s at
N = 1, 2, 4 on a synthetic shape, and whether every stream's greedy tokens equal its
prompt's tokens alone (exact mode per stream). Writes $OUT/gpu_parallel-<preset>-<date>.json.

    PYTHONUNBUFFERED=1 python bench/gpu_parallel.py [--preset qwen3-8b] [--layers N] [--experts E]
        [--ns 1 2 4] [--prompt 512] [--tokens 128] [--spec none|ngram] [--commit SHA]

One model is loaded once (GPUModel, or GPUHybridModel for a Gated DeltaNet hybrid such as
--preset qwen36-35b-a3b --layers 8 --experts 32); each N gets an engine of N slots on it (its
cache and graphs made anew: new_cache(slots=N)). N = 1 runs each prompt alone, one after another (the
single-stream path, -np 1); N > 1 starts N streams of different prompts at once and steps
them (streams.Streams: one prefill chunk a step, one shared round). Decode figures count
from the step where the last stream finished its prompt (tokens and time before it are
reported apart as `prefill_phase`), so they are the shared rounds' rate: aggregate tok/s
= tokens / s over all streams, per stream = aggregate / N (the streams run in lockstep;
each stream's own predicted_per_second is listed too). The prompts are seeded random
tokens (--prompt long; the depth the rounds attend to), greedy, no end-of-generation
(synthetic weights): every stream generates --tokens tokens.

With --experts-in-vram F an MoE preset runs on an expert store (GPUModel only) whose bank holds
that fraction of the routed experts (the CPU workers as `serve` starts them): every N starts from
the store's start layout (`reset`), and each run records the store's hit rate, admissions and
admitted bytes, per round and per token (offload/admission.py: each stream of a round brings a
one-stream round's admission budget), beside `equal_alone` (a stream's tokens do not depend on
the others nor on which tier served an expert).

CPU smoke (the interpreter; small attention tiles keep it short):
    TRITON_INTERPRET=1 python bench/gpu_parallel.py --device cpu --preset tiny-qwen3 --layers 1 \\
        --prompt 8 --tokens 4 --ns 1 2 --small-tiles
    TRITON_INTERPRET=1 python bench/gpu_parallel.py --device cpu --preset tiny-qwen35moe --layers 2 \\
        --experts 4 --prompt 8 --tokens 3 --ns 1 2 --small-tiles
    TRITON_INTERPRET=1 python bench/gpu_parallel.py --device cpu --preset tiny-qwen3moe --layers 2 \
        --experts 8 --prompt 8 --tokens 3 --ns 1 2 --small-tiles --experts-in-vram 0.25
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.engine import Engine, Generation
from alphallama.gguf.arch import load_config
from alphallama.gguf.arch_qwen35 import HybridConfig
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.runtime.gpu_hybrid import GPUHybridModel
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides
from alphallama.spec.config import SpecConfig
from alphallama.streams import Streams
from alphallama.tokenizer import Tokenizer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def store_figures(model, tokens: int) -> dict | None:
    """The expert store's counters since its reset (None: no store): hit rate, admissions and
    admitted bytes, per store round (each pass, prompt chunks of up to 64 rows included) and
    per token generated."""
    store = getattr(model, "store", None)
    if store is None:
        return None
    store.before_round()                                   # (the last round's routing observed)
    st = store.stats.to_dict()
    return {**st, "admit_bytes_per_round": store.admit_bytes_per_round, "slots": store.slots,
            "admissions_per_round": st["admissions"] / max(st["rounds"], 1),
            "admissions_per_token": st["admissions"] / max(tokens, 1),
            "admitted_bytes_per_token": st["admitted_bytes"] / max(tokens, 1),
            "footprint": store.footprint.to_dict()}


def _reset_store(model) -> None:
    if getattr(model, "store", None) is not None:
        model.store.reset()


def alone(model, f, tok, prompts, n_tokens: int, ctx: int, spec: SpecConfig, device: str) -> dict:
    """N = 1: each prompt alone on a one-slot engine (the single-stream path)."""
    _reset_store(model)
    t0 = time.perf_counter()
    eng = Engine(f, model, tok, None, ctx, slots=1)
    setup_s = time.perf_counter() - t0
    out = []
    for p in prompts:
        eng.reset()
        g = Generation()
        _sync(device)
        ids = list(eng.generate(p, n_tokens, gen=g, spec=spec))
        _sync(device)
        out.append({"tokens": ids, "tok_s": g.stats.predicted_per_second, "prompt_ms": g.stats.prompt_ms,
                    "rounds": g.stats.rounds, "draft_n_accepted": g.stats.draft_n_accepted})
    rate = sum(o["tok_s"] for o in out) / len(out)
    return {"N": 1, "setup_s": setup_s, "aggregate_tok_s": rate, "per_stream_tok_s": rate, "streams": out,
            "store": store_figures(model, sum(len(o["tokens"]) for o in out))}


def together(model, f, tok, prompts, n_tokens: int, ctx: int, spec: SpecConfig, device: str) -> dict:
    """N = len(prompts) streams started at once, stepped to their ends."""
    N = len(prompts)
    _reset_store(model)
    t0 = time.perf_counter()
    eng = Engine(f, model, tok, None, ctx, slots=N)
    setup_s = time.perf_counter() - t0
    streams = Streams(eng)
    got: list[list[int]] = [[] for _ in prompts]
    gens = [Generation() for _ in prompts]

    def taker(i):
        return lambda t: got[i].append(t) is None
    _sync(device)
    t_start = time.perf_counter()
    runs = [streams.add(p, n_tokens, taker(i), gen=gens[i], spec=spec) for i, p in enumerate(prompts)]
    steps = 0
    while any(r.prefilling for r in streams.runs):
        for r in streams.step():
            if r.error is not None:
                raise r.error
        steps += 1
    _sync(device)
    t_prefilled = time.perf_counter()
    n_prefill_phase = sum(map(len, got))
    while streams.runs:
        for r in streams.step():
            if r.error is not None:
                raise r.error
    _sync(device)
    t_end = time.perf_counter()
    n_total = sum(map(len, got))
    decode_s = t_end - t_prefilled
    agg = (n_total - n_prefill_phase) / decode_s if decode_s > 0 else 0.0
    rows = [x for r in runs for x in r.rows]
    return {"N": N, "setup_s": setup_s, "aggregate_tok_s": agg, "per_stream_tok_s": agg / N,
            "decode_s": decode_s, "tokens": n_total,
            "prefill_phase": {"s": t_prefilled - t_start, "steps": steps, "tokens": n_prefill_phase},
            "rows_per_stream_round": sum(rows) / len(rows) if rows else 0.0,
            "store": store_figures(model, n_total),
            "streams": [{"tokens": got[i], "tok_s": g.stats.predicted_per_second, "prompt_ms": g.stats.prompt_ms,
                         "rounds": g.stats.rounds, "draft_n_accepted": g.stats.draft_n_accepted}
                        for i, g in enumerate(gens)]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None, help="routed experts kept (default: the preset's)")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of each stream")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each stream generates")
    ap.add_argument("--spec", default="none", choices=["none", "ngram"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small-tiles", action="store_true", help="attention tiles (16, 4): the CPU smoke's")
    ap.add_argument("--experts-in-vram", type=float, default=None, metavar="F",
                    help="an MoE preset on an expert store whose bank holds this fraction of the experts")
    ap.add_argument("--commit", default=None, help="the commit measured (the device copy is no git checkout)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    path = f"/tmp/parallel-{args.preset}.gguf"
    overrides = {"n_layers": args.layers} if args.layers else {}
    if args.experts:
        overrides["n_experts"] = args.experts
    t0 = time.perf_counter()
    write_synthetic(PRESETS[args.preset](**overrides), path)
    res = {"host": host_state(sys.argv), "commit": args.commit, "preset": args.preset, "overrides": overrides,
           "args": vars(args), "write_s": time.perf_counter() - t0}
    name = f"gpu_parallel-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    save = lambda: (out_dir / name).write_text(json.dumps(res, indent=1, default=str))  # noqa: E731
    f = GGUFFile(path)
    ctx = args.prompt + args.tokens + 80            # each slot's context (room for a round's drafts)
    ctx = max(ctx, 128)
    t0 = time.perf_counter()
    o = Overrides(attention_tiles=(16, 4)) if args.small_tiles else Overrides()
    cfg = load_config(f)
    runtime = GPUHybridModel if isinstance(cfg, HybridConfig) else GPUModel
    store = {}
    if args.experts_in_vram is not None:
        if runtime is not GPUModel or not cfg.is_moe:
            raise SystemExit("--experts-in-vram: an MoE preset on GPUModel (the hybrids keep their experts resident)")
        store = {"expert_slots": max(1, int(args.experts_in_vram * cfg.n_layers * cfg.n_experts))}
    model = runtime(f, ctx, device=args.device, overrides=o, **store)
    res["runtime"] = runtime.__name__
    res["load_s"] = time.perf_counter() - t0
    tok = Tokenizer.from_metadata(f.metadata)
    spec = SpecConfig(args.spec, 16, 2, gate=False) if args.spec == "ngram" else SpecConfig("none")
    g = torch.Generator().manual_seed(29)
    n_max = max(args.ns)
    prompts = []
    for _ in range(n_max):       # repeats give the copy drafter matches (--spec ngram)
        base = torch.randint(model.cfg.vocab_size, (max(1, args.prompt // 4),), generator=g).tolist()
        prompts.append((base * 4 + base)[:args.prompt])
    res["runs"] = []
    solo = alone(model, f, tok, prompts, args.tokens, ctx, spec, args.device)
    res["runs"].append(solo)
    save()
    for N in args.ns:
        if N == 1:
            continue
        r = together(model, f, tok, prompts[:N], args.tokens, ctx, spec, args.device)
        r["equal_alone"] = [s["tokens"] == a["tokens"] for s, a in zip(r["streams"], solo["streams"])]
        res["runs"].append(r)
        save()
    res["all_equal_alone"] = all(all(r.get("equal_alone", [True])) for r in res["runs"])
    save()
    print(f"{'N':>3} {'aggregate tok/s':>16} {'per stream':>11} {'rows/round':>11} {'hit rate':>9} "
          f"{'adm/token':>10}  equal alone")
    for r in res["runs"]:
        st = r.get("store") or {}
        print(f"{r['N']:>3} {r['aggregate_tok_s']:16.1f} {r['per_stream_tok_s']:11.1f} "
              f"{r.get('rows_per_stream_round', 1.0):11.2f} {st.get('hit_rate', float('nan')):9.3f} "
              f"{st.get('admissions_per_token', float('nan')):10.3f}  {r.get('equal_alone', '-')}")
    print(f"wrote {out_dir / name}")
    return 0 if res["all_equal_alone"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""One device call: models larger than the GPU, emulated with --gpu-mem on the H200.

Synthetic Qwen3-30B-A3B-shaped Q4_K_M (the first --layers layers: the device budget
does not allow writing all 48), then, in one process:
  - the engine with every expert resident (the control),
  - the expert store with the plan's bank at --gpu-mem budgets that fit 100%, 50% and
    25% of the expert bytes (at 100% the plan itself picks "resident": the store is
    forced to hold every expert, to show its own overhead),
each decoding the same prompt greedily: tok/s, ms/round, hit rate, admissions, host
threads; the generated tokens and the first logits are compared bitwise with the
control and with the first store row (where an expert lives must not change the bits). Also the torch CPU cost of
one expert (the measurement behind computing host-tier experts on the GPU over PCIe
instead of on CPU workers; docs/decisions/three-tiers.md). Writes $OUT/gpu_offload-*.json.

    python bench/gpu_offload.py [--layers 12] [--tokens 128]
    python bench/gpu_offload.py --device cpu --preset tiny-qwen3moe --tokens 4   # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.offload.plan import make_plan
from alphallama.runtime import gpu_model


def _engine(path: str, ctx: int, device: str, slots: int | None, cpu_tier: bool = False, threads: int | None = None,
            host_bytes: int | None = None, miss_rates=None):
    from alphallama.chat import ChatTemplate
    from alphallama.engine import Engine
    from alphallama.tokenizer import Tokenizer
    f = GGUFFile(path)
    t0 = time.perf_counter()
    from alphallama.gguf.arch import load_config
    from alphallama.gguf.arch_qwen35 import HybridConfig
    from alphallama.runtime.gpu_hybrid import GPUHybridModel
    runtime = GPUHybridModel if isinstance(load_config(f), HybridConfig) else gpu_model.GPUModel   # (a DeltaNet hybrid)
    model = runtime(f, ctx, device, expert_slots=slots, cpu_tier=cpu_tier, cpu_threads=threads,
                    host_bytes=host_bytes, miss_rates=miss_rates)
    load_s = time.perf_counter() - t0
    eng = Engine(f, model, Tokenizer.from_metadata(f.metadata), ChatTemplate.from_gguf_metadata(f.metadata, None), ctx)
    return eng, load_s, model.capture_s


def _decode(eng, prompt: list[int], n: int, spec=None) -> dict:
    from alphallama.engine import Generation
    from alphallama.spec.config import SpecConfig
    gen = Generation()
    toks = list(eng.generate(prompt, n, stop_ids=set(), gen=gen, spec=spec or SpecConfig()))
    s = gen.stats
    return {"tokens": toks, "tok_s": s.predicted_per_second, "rounds": s.rounds,
            "ms_per_round": s.predicted_ms / max(s.rounds, 1), "prompt_ms": s.prompt_ms,
            "draft_n": s.draft_n, "draft_n_accepted": s.draft_n_accepted}


def _first_logits(eng, prompt: list[int]) -> torch.Tensor:
    eng.reset()
    logits, _ = eng.model.forward(torch.tensor(prompt), 0, eng.cache)
    out = logits[-1].float().cpu().clone()
    eng.reset()
    return out


def cpu_expert_ms(path: str, threads: int, reps: int = 3) -> dict:
    """Torch on the CPU, one expert of layer 0 from its planes (dequantize + matvec):
    what a CPU worker would spend per host-tier expert per row."""
    from alphallama.offload.store import pack_experts
    f = GGUFFile(path)
    t = f.tensors
    gu, dn = pack_experts(t["blk.0.ffn_gate_exps.weight"], t["blk.0.ffn_up_exps.weight"],
                          t["blk.0.ffn_down_exps.weight"], "cpu")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.randn(1, gu.K)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        e = r % gu.shape[0]
        y = x @ gu.expert(e).dequantize().T                                   # [1, 2F]
        F = y.shape[1] // 2
        act = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
        _ = act @ dn.expert(e).dequantize().T                                 # [1, D]
        times.append(1000 * (time.perf_counter() - t0))
    torch.set_num_threads(old)
    return {"threads": threads, "ms_per_expert": min(times), "expert_bytes": (gu.nbytes + dn.nbytes) // gu.shape[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fractions", type=float, nargs="*", default=[1.0, 0.5, 0.25])
    ap.add_argument("--shares", type=float, nargs="*", default=[1.0, 0.0, 0.6],
                    help="CPU-tier arms per budget: share of a layer's host pairs the CPU takes (0: all over PCIe)")
    ap.add_argument("--threads", type=int, default=None, help="CPU workers (default: the probe's count)")
    ap.add_argument("--no-control", action="store_true", help="skip the resident control (time)")
    ap.add_argument("--buckets", type=int, nargs="*", default=[1, 64],
                    help="graph widths captured (decode needs 1; fewer widths = shorter capture)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    gpu_model.BUCKETS = tuple(sorted(set(args.buckets) | {gpu_model.MAX_W}))
    path = "/tmp/offload-synth.gguf"
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "preset": args.preset,
           "layers": args.layers, "tokens": args.tokens, "ctx": args.ctx, "buckets": gpu_model.BUCKETS}
    t0 = time.perf_counter()
    write_synthetic(PRESETS[args.preset](n_layers=args.layers), path)
    res["write_s"] = time.perf_counter() - t0
    print(f"wrote {path} ({args.layers} layers) in {res['write_s']:.1f} s", flush=True)
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    rows = []
    ref = {"tokens": None}
    ref_logits = None
    if not args.no_control:
        eng, load_s, cap_s = _engine(path, args.ctx, args.device, None)
        ref_logits = _first_logits(eng, prompt)
        ref = _decode(eng, prompt, args.tokens)
        rows.append({"config": "resident (no store)", "slots": None, "load_s": load_s, "capture_s": cap_s,
                     **{k: v for k, v in ref.items() if k != "tokens"}})
        print(json.dumps(rows[-1]), flush=True)
        del eng
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    base = make_plan(path, ctx=args.ctx, gpu_mem=1 << 50)   # sizes only
    s = base.sizes
    fixed = s.dense + s.kv + s.workspace
    res["sizes"] = s.__dict__
    name = f"gpu_offload-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save(rows):   # after every row: a run cut short by the call's limit keeps what it measured
        (out_dir / name).write_text(json.dumps({**res, "rows": rows}, indent=1, default=str))
    store_logits: dict[int, torch.Tensor] = {}
    store_tokens: dict[int, list] = {}
    for frac in args.fractions:
        gpu_mem = fixed + int(frac * s.experts) + (1 << 20)
        plan = make_plan(path, ctx=args.ctx, gpu_mem=gpu_mem)
        slots = plan.slots if plan.layout == "offload" else s.n_experts
        row = {"config": f"store, --gpu-mem for {int(100 * frac)}% of experts", "gpu_mem": gpu_mem,
               "plan_layout": plan.layout, "plan_slots": plan.slots, "slots": slots,
               "host_threads": {"launch": 1, "cpu_workers": 0, "copy_streams": 1, "plan_cpu_threads": plan.cpu_threads}}
        try:
            eng, load_s, cap_s = _engine(path, args.ctx, args.device, slots, cpu_tier=True, threads=args.threads)
            st, model = eng.model.store, eng.model
            row["resident_fraction"] = st.slots / s.n_experts
            row["bank_bytes"], row["host_bytes"] = st.bank_bytes, st.host_bytes
            row["load_s"], row["capture_s"] = load_s, cap_s
            if model.cpu_experts is not None:
                row["host_threads"].update(cpu_workers=model.cpu_experts.threads, worker_cpus=model.cpu_experts.cpus)
            logits = _first_logits(eng, prompt)
            row["first_logits_equal_to_first_store_row"] = bool(torch.equal(logits, store_logits.setdefault(0, logits)))
            if ref_logits is not None:   # the resident control's (its experts by another path: a distance, not bits)
                row["first_logits_max_abs_diff_to_control"] = float((logits.float() - ref_logits.float()).abs().max())
            arms = args.shares if model.cpu_link is not None else [None]
            for q in arms:
                arm = dict(row, config=row["config"] + (f", CPU share {q:.2f}" if q is not None else ", no CPU tier"),
                           cpu_share=q)
                if q is not None:
                    model.cpu_link.set_share(q)
                st.reset()   # every arm from the start layout and a fresh policy
                out = _decode(eng, prompt, args.tokens)
                st.before_round()
                arm.update(**{k: v for k, v in out.items() if k != "tokens"},
                           **{("store_" + k if k == "rounds" else k): v for k, v in st.stats.to_dict().items()},
                           tokens_equal_control=out["tokens"] == ref["tokens"],
                           # the contract at another residency and CPU share: the same tokens
                           tokens_equal_first_store_arm=out["tokens"] == store_tokens.setdefault(0, out["tokens"]))
                rows.append(arm)
                print(json.dumps(arm), flush=True)
                save(rows)
            del eng, st, model
        except Exception as e:   # keep the rows measured so far
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    res["rows"] = rows
    try:
        res["cpu_expert"] = cpu_expert_ms(path, max(base.cpu_threads, 1))
        from alphallama.offload.native.probe import probe
        res["cpu_probe"] = probe()
    except Exception as e:
        res["cpu_expert"] = {"error": f"{type(e).__name__}: {e}"}
    res["host_end"] = host_state(sys.argv).get("gpus") if args.device == "cuda" else None
    (out_dir / name).write_text(json.dumps(res, indent=1, default=str))
    print(f"{'config':58} {'slots':>6} {'hit':>6} {'tok/s':>8} {'ms/rnd':>7} {'adm':>5} {'thr':>4} {'same':>5}")
    for r in rows:
        print(f"{r['config']:58} {str(r.get('slots')):>6} {r.get('hit_rate', 1.0):6.2f} {r.get('tok_s', 0):8.1f} "
              f"{r.get('ms_per_round', 0):7.2f} {r.get('admissions', 0):5} "
              f"{str(r.get('host_threads', {}).get('cpu_workers', '-')):>4} "
              f"{str(r.get('tokens_equal_first_store_arm', '-')):>5}"
              + (f"  {r['error']}" if "error" in r else ""))
    print("cpu expert:", res["cpu_expert"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

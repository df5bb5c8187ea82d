"""One device call for issue 34 (offload v2): the 30B-A3B shape at 100 / 50 / 25 / 10% of the
expert bytes in VRAM, and the mapped tier under a RAM cap, in one process.

Arms (each from the store's start layout, the same prompt, plain greedy unless named):
  - the engine with every expert resident (the control; skipped with --no-control),
  - the store at --gpu-mem budgets for each --fractions (CPU workers on, their share of the
    misses tuned on the rounds: offload/share_tuner.py, its final share and decisions in the
    row): tok/s, ms/round, hit rate, admissions, and the plan's expected tok/s at the
    host's measured bandwidths (offload/estimate.py) beside the measured one; every store arm
    first decodes --tune-tokens from another prompt of the same kind (the bank warms, the
    share settles), then the timed --tokens,
  - the same budgets for each --pcie-only-fractions without CPU workers: the store's bank and
    host rows on the resident int8 kernels (moe_i8 with its table), so 100% against 100% with
    workers is what the contract's kernels cost a round (offload-v2.md part 3's question),
  - at --spec-fraction: the n-gram copy drafter (exact mode) on a repetitive prompt, its
    tokens against the plain arm's at the same budget (speculative == plain under offload
    with admissions happening): gated (the cost table timed under the store, priced with
    the misses a column adds: spec/offload_costs.py; its prices and footprint recorded)
    and ungated (every draft verified), drafted / accepted tokens beside tok/s,
  - prefill with a store: a --prefill-tokens prompt through the model's prefill path at each
    --prefill-fractions and the resident control, in chunks of each --prefill-chunks rows (a
    store's chunk reads every missed expert once over PCIe: a larger chunk reads the host tier
    fewer times a prompt; the question behind "the prefill borrowing the bank"),
  - the mapped tier: --host-frac of the expert bytes allowed in pinned RAM (the rest of
    the layers read from the mapped file) at --mapped-fraction in VRAM, warm (the page
    cache holds the file) and cold (the mapped layers' pages dropped after the warm-up, before
    the timed decode: out of this process's mapping, then out of the page cache, each expert
    then read from the disk the first time the decode needs it; the share of their pages in
    RAM before and after the timing in the row),
and every store arm's tokens against the first store arm's (a token's bits may not depend
on where an expert lived). --timeline-tokens N: after an arm's timing, N more tokens under the
profiler, the GPU's kernels a round by kind (alphallama/bench/timeline.py: the combine's spin is
the GPU waiting for the CPU workers; idle is launches and gaps) in the row's "timeline".
Writes $OUT/gpu_offload_v2-*.json after every arm.

    python bench/gpu_offload_v2.py [--layers 12] [--tokens 64] [--tune-tokens 256]
    TRITON_INTERPRET=1 python bench/gpu_offload_v2.py --device cpu --preset tiny-qwen3moe --quant Q4_K_M \\
        --layers 2 --tokens 3 --tune-tokens 0 --prompt 6 --ctx 128 --no-control   # CPU smoke (~8 min on 2 cores)
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.bench.timeline import kernel_trace, summarize
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.offload.host_probe import Bandwidths, measure, resident_share
from alphallama.offload.plan import make_plan
from alphallama.spec.config import SpecConfig

sys.path.insert(0, str(Path(__file__).parent))
from gpu_offload import _decode, _engine  # noqa: E402  (the v1 script's engine and decode helpers)


_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4


def _ranges(store) -> list[tuple[int, int]]:
    """(address, bytes) of every mapped layer's expert tensors in the mapping."""
    return [(t.data.ctypes.data, t.data.nbytes) for m in store.mapped.values() for t in (m.gate, m.up, m.down)]


def drop_mapped(store, path: str) -> float:
    """The mapped layers' pages out of RAM, returning the share still resident after: first out
    of this process's mapping (madvise MADV_DONTNEED drops its page-table entries; the page
    cache never evicts a page a process maps, so posix_fadvise alone left session 47's "cold"
    arm warm), then out of the page cache (fsync, then posix_fadvise DONTNEED on the file)."""
    ranges = _ranges(store)
    for addr, n in ranges:
        lo = addr - addr % _PAGE                       # madvise takes a page-aligned start
        if _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(addr + n - lo), MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED)")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)           # a freshly written file's dirty pages are never dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_share(ranges)


def prefill_ms(eng, ids: list[int], chunks: list[int], reps: int = 2) -> dict[str, float]:
    """The prompt's prefill through the model alone (no engine chunking), per chunk size: the
    best of `reps` after one warm-up (graphs, the bank's first reads)."""
    m, toks, out = eng.model, torch.tensor(ids), {}
    keep = m.prefill_chunk
    for chunk in chunks:
        m.prefill_chunk = chunk
        times = []
        for _ in range(reps + 1):
            eng.reset()
            t0 = time.perf_counter()
            m.forward(toks, 0, eng.cache)
            if torch.device(m.device).type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[str(chunk)] = 1e3 * min(times[1:])
    m.prefill_chunk = keep
    eng.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--quant", default=None, help="the preset's quant mix (default: its own)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fractions", type=float, nargs="*", default=[1.0, 0.5, 0.25, 0.1])
    ap.add_argument("--pcie-only-fractions", type=float, nargs="*", default=[1.0, 0.5],
                    help="budgets also run without CPU workers: the bank on the resident int8 kernels (moe_i8's "
                         "table), misses read over PCIe; at 1.0 against the workers' 100%%: what the contract costs")
    ap.add_argument("--spec-fraction", type=float, default=0.25, help="the budget of the speculative arm (0: none)")
    ap.add_argument("--mapped-fraction", type=float, default=0.25, help="VRAM share of the mapped arms (0: none)")
    ap.add_argument("--host-frac", type=float, default=0.5, help="expert bytes the mapped arms allow in pinned RAM")
    ap.add_argument("--prefill-tokens", type=int, default=1536)
    ap.add_argument("--prefill-chunks", type=int, nargs="*", default=[512, 1536])
    ap.add_argument("--prefill-fractions", type=float, nargs="*", default=[0.25])
    ap.add_argument("--threads", type=int, default=None, help="CPU workers (default: the probe's count)")
    ap.add_argument("--tune-tokens", type=int, default=256,
                    help="tokens decoded before each store arm's timed run: the bank warms, the CPU share is tuned (0: none)")
    ap.add_argument("--no-control", action="store_true", help="skip the resident control (time)")
    ap.add_argument("--timeline-tokens", type=int, default=0,
                    help="tokens decoded under the profiler after each arm's timing (0: none)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "."))
    path = "/tmp/offload-v2-synth.gguf"
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "preset": args.preset,
           "layers": args.layers, "tokens": args.tokens, "ctx": args.ctx}
    t0 = time.perf_counter()
    write_synthetic(PRESETS[args.preset](n_layers=args.layers, **({"quant": args.quant} if args.quant else {})), path)
    res["write_s"] = time.perf_counter() - t0
    res["bandwidths"] = measure(path, cache=False).to_dict()
    print(f"wrote {path} in {res['write_s']:.1f} s; bandwidths {res['bandwidths']}", flush=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
    motif = torch.randint(0, 256, (8,), generator=g).tolist()
    long_prompt = torch.randint(0, 256, (args.prefill_tokens,), generator=g).tolist()
    repeat = (motif * (args.prompt // 8 + 1))[:args.prompt]     # the copy drafter finds matches in it
    # the warm-up decodes other prompts than the timed run: decoding the timed prompt first would
    # leave the bank holding exactly the experts the timed tokens route to (session 49's hit rates)
    tune_plain = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
    tune_motif = torch.randint(0, 256, (8,), generator=g).tolist()
    tune_repeat = (tune_motif * (args.prompt // 8 + 1))[:args.prompt]
    s = make_plan(path, ctx=args.ctx, gpu_mem=1 << 50).sizes
    fixed = s.dense + s.kv + s.workspace
    res["sizes"] = s.__dict__
    name = f"gpu_offload_v2-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows: list[dict] = []
    first: dict[str, list] = {}

    def save():   # after every arm: a run cut short by the call's limit keeps what it measured
        (out_dir / name).write_text(json.dumps({**res, "rows": rows}, indent=1, default=str))

    bw = Bandwidths(**{k: v for k, v in res["bandwidths"].items() if k != "source"})

    def timeline(eng, ids: list[int], spec: SpecConfig | None = None) -> dict | None:
        """The GPU's kernels over --timeline-tokens more tokens, a round by kind."""
        if not args.timeline_tokens:
            return None
        with kernel_trace() as trace:
            out = _decode(eng, ids, args.timeline_tokens, spec)
        return summarize(trace.kernels, out["rounds"]) | {"tok_s_profiled": out["tok_s"]}

    def run_arm(config: str, frac: float, host_bytes: int | None = None, spec: SpecConfig | None = None,
                cold: bool = False, ids: list[int] = prompt, key: str = "plain", workers: bool = True,
                prefill: bool = False, tune_ids: list[int] = tune_plain) -> None:
        """key: the arms whose tokens must be equal (the same prompt); workers False: no CPU
        tier (the bank and the host rows on the resident int8 kernels, moe_i8 with its table)."""
        gpu_mem = fixed + int(frac * s.experts) + (1 << 20)
        plan = make_plan(path, ctx=args.ctx, gpu_mem=gpu_mem, host_mem=host_bytes, bandwidths=bw)
        n = plan.slots if plan.layout == "offload" else s.n_experts
        row = {"config": config, "gpu_mem": gpu_mem, "slots": n, "plan_layout": plan.layout,
               "expected": plan.estimate.to_dict() if plan.estimate else None,
               "host": plan.host.to_dict() if plan.host else None}
        try:
            eng, load_s, cap_s = _engine(path, args.ctx, args.device, n, cpu_tier=workers, threads=args.threads,
                                         host_bytes=host_bytes, miss_rates=plan.estimate.miss if plan.estimate else None)
            st = eng.model.store
            row.update(load_s=load_s, capture_s=cap_s, resident_fraction=st.slots / s.n_experts,
                       bank_bytes=st.bank_bytes, host_bytes=st.host_bytes, mapped_bytes=st.mapped_bytes,
                       mapped_layers=sorted(st.mapped))
            tuner = eng.model.share_tuner
            if args.tune_tokens:   # every store arm warms up (its bank, the CPU share's tuner) before the timing
                _decode(eng, tune_ids, args.tune_tokens, spec)
            if st.mapped:          # the share of the mapped layers' pages in RAM as the timing starts and ends
                row["mapped_resident_share"] = drop_mapped(st, path) if cold else resident_share(_ranges(st))
            out = _decode(eng, ids, args.tokens, spec)
            if st.mapped:
                row["mapped_resident_share_after"] = resident_share(_ranges(st))
            if tuner is not None:
                row.update(cpu_share=tuner.share, share_decisions=list(tuner.decisions))
            if spec is not None and spec.gate:   # the gate's prices as the run left them (timing included)
                costs = spec.cost_table(eng)
                row["gate_prices"] = {**costs.to_dict(), "table_ms": {w: costs.base.cost(w) for w in (1, 2, 4, 8, 16)},
                                      "table_timed_widths": costs.base.measured,
                                      "table_measure_s": costs.base.measure_s}
            st.before_round()
            row.update(**{k: v for k, v in out.items() if k != "tokens"},
                       **{("store_" + k if k == "rounds" else k): v for k, v in st.stats.to_dict().items()},
                       readahead_hints=st.readahead.hints if st.readahead else 0,
                       tokens_equal_first_store_arm=out["tokens"] == first.setdefault(key, out["tokens"]))
            row["timeline"] = timeline(eng, ids, spec)
            if prefill:   # after the decode's figures: the prompt's routing moves the bank
                row["prefill_ms"] = prefill_ms(eng, long_prompt, args.prefill_chunks)
            del eng, st
        except Exception as e:   # keep the arms measured so far
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("host",)}), flush=True)
        save()
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    if not args.no_control:
        eng, load_s, cap_s = _engine(path, args.ctx, args.device, None)
        out = _decode(eng, prompt, args.tokens)
        if args.prefill_chunks:
            out["prefill_ms"] = prefill_ms(eng, long_prompt, args.prefill_chunks)
        out["timeline"] = timeline(eng, prompt)
        rows.append({"config": "resident (no store)", "load_s": load_s, "capture_s": cap_s,
                     "expected": make_plan(path, ctx=args.ctx, gpu_mem=1 << 50, bandwidths=bw).estimate.to_dict(),
                     **{k: v for k, v in out.items() if k != "tokens"}})
        del eng
        save()
    for frac in args.fractions:   # at 100% the plan picks "resident": the store holds every expert
        run_arm(f"store, --gpu-mem for {int(100 * frac)}% of experts", frac,
                prefill=frac in args.prefill_fractions and bool(args.prefill_chunks))
    for frac in args.pcie_only_fractions:   # the contract kernels' share of a round: the same budgets, no CPU tier
        run_arm(f"store, --gpu-mem for {int(100 * frac)}% of experts, no CPU workers (PCIe only)", frac,
                workers=False)
    if args.spec_fraction:
        f = args.spec_fraction
        run_arm(f"store {int(100 * f)}%, repetitive prompt, plain", f, ids=repeat, key="repeat", tune_ids=tune_repeat)
        for how, spec in (("gate priced with its misses", SpecConfig(spec_type="ngram")),
                          ("ungated", SpecConfig(spec_type="ngram", gate=False))):   # (not `name`: the JSON's)
            run_arm(f"store {int(100 * f)}%, repetitive prompt, n-gram (exact), {how}", f, spec=spec, ids=repeat,
                    key="repeat", tune_ids=tune_repeat)
    if args.mapped_fraction:
        f, cap = args.mapped_fraction, int(args.host_frac * s.experts)
        for cold in (False, True):
            run_arm(f"store {int(100 * f)}%, pinned RAM for {int(100 * args.host_frac)}% of experts, rest mapped, "
                    + ("cold page cache" if cold else "warm page cache"), f, host_bytes=cap, cold=cold)
    res["rows"] = rows
    res["host_end"] = host_state(sys.argv).get("gpus") if args.device == "cuda" else None
    save()
    print(f"{'config':84} {'hit':>5} {'tok/s':>8} {'exp':>7} {'ms/rnd':>7} {'adm':>4} {'same':>5} {'share':>5}")
    for r in rows:
        exp = (r.get("expected") or {}).get("tok_s", 0)
        print(f"{r['config'][:84]:84} {r.get('hit_rate', 1.0):5.2f} {r.get('tok_s', 0):8.1f} {exp:7.0f} "
              f"{r.get('ms_per_round', 0):7.2f} {r.get('admissions', 0):4} "
              f"{str(r.get('tokens_equal_first_store_arm', '-')):>5} {r.get('cpu_share', '-'):>5}"
              + (f"  {r['error']}" if "error" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

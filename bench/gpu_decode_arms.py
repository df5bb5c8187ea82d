"""The decode options side by side, one device call: ms per round at W = 1, 2, 4, 8 for
each arm on a synthetic shape (all arms in one process, same file, same depth), the
share of the bandwidth floor, and the exactness checks at full size: every arm's W=8
rows bit-identical to the same rows run alone, and the PDL arms bit-identical to their
arm without PDL (same kernels, only the launch differs).

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_decode_arms.py --preset qwen3-8b [--layers N]

Arms (runtime/overrides.Overrides fields, fast mode, registry variants, passed to GPUModel):
f32 (qmatmul GEMVs: the control), i8 (int8-activation GEMVs, a prepare launch per input),
i8+fuse (the producers emit the int8 activations), i8+fuse+pdl (programmatic dependent
launch), for MoE shapes +moe_i8 (the routed experts on int8 activations), and the
defaults with one change each. Writes $OUT/gpu_decode_arms-*.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.engine_bench import copy_bandwidth, kv_bytes_per_token, time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.arch import load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.kernels.gemv.registry import DEFAULT_KERNELS
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides

ARMS = {"f32": dict(decode_gemv="f32", moe_gemv="f32", fuse_q8=False, pdl=False),
        "i8": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=False, pdl=False),
        "i8+fuse": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=True, pdl=False),
        "i8+fuse+pdl": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=True, pdl=True)}
MOE_ARMS = {"i8+fuse+moe_i8": dict(decode_gemv="i8", moe_gemv="i8", fuse_q8=True, pdl=False),
            "i8+fuse+moe_i8+pdl": dict(decode_gemv="i8", moe_gemv="i8", fuse_q8=True, pdl=True)}
# the defaults (runtime/overrides.py) and one-change variants of them, each an Overrides
# field (or fast mode, or a registry variant: qgemv_mma_k's row groups); the lost ones
# (tile and warp-count variants, fusions measured slower) are in docs/decisions/lost-experiments.md
DEFAULT_ARMS = {"default": {},
                "default/combine-launch": dict(combine_in_norm=False),
                "default/no-early-kv": dict(early_kv=False),
                "default/no-norm-router": dict(norm_router=False),
                "default/no-split": dict(gemv_split=False),
                # the Q4_K weights on the mma at every width (Q6_K and the head on dp4a)
                "default/mma-k": dict(gemv_mma=True, gemv_mma_narrow=0),
                # Q4_K: qgemv_q8k at W <= 4 (or 1, 2), the mma wider (the same bits); Q6_K and the head on dp4a
                "default/mma-wide": dict(gemv_mma=True, gemv_mma_narrow=4),
                "default/mma-wide1": dict(gemv_mma=True, gemv_mma_narrow=1),
                "default/mma-wide2": dict(gemv_mma=True, gemv_mma_narrow=2),
                # fast mode's hybrid (--fast; fast_mma_narrow): the default's kernels up to narrow rows,
                # the mma family wider; not rotation-exact by design, W = 8 the mma family's bits
                "default/fast": dict(fast=True),
                # the same with one row group a warp at every width (qgemv_mma.mma_groups' control; the same bits)
                "default/fast-g1": dict(fast=True, mma_groups=1),
                "default/mma-wide2-g2": dict(gemv_mma=True, gemv_mma_narrow=2, mma_groups=2),
                # Q4_K through qgemv_q8k (dp4a on q8_K activations) at every width: no tensor cores
                "default/q8k": dict(gemv_mma=True, gemv_mma_narrow=64)}
# arms that must give another arm's logits bit for bit (only the launches differ)
SAME_BITS = {"default/combine-launch": "default", "default/no-early-kv": "default", "i8+fuse+pdl": "i8+fuse",
             "default/mma-wide2-g2": "default/mma-wide2", "default/fast": "default/mma-wide2",
             "default/fast-g1": "default/fast", "i8+fuse+moe_i8+pdl": "i8+fuse+moe_i8"}
WIDTHS = (1, 2, 4, 8, 16)


def run_arm(f: GGUFFile, kw: dict, depth: int, reps: int, toks: torch.Tensor, device: str = "cuda",
            widths: tuple[int, ...] = WIDTHS) -> dict:
    """One arm: its Overrides, fast mode, and a registry variant, passed to the model (no
    product module is patched)."""
    kw = dict(kw)
    fast = kw.pop("fast", False)
    groups = kw.pop("mma_groups", None)   # qgemv_mma_k's row groups a warp (not in the float order; None: its rule)
    kernels = DEFAULT_KERNELS.with_mma_groups(groups) if groups is not None else DEFAULT_KERNELS
    model = GPUModel(f, 4096 if device == "cuda" else 256, device, fast=fast, overrides=Overrides(**kw),
                     kernels=kernels)
    return _run_arm(model, depth, reps, toks, device, widths)


def _run_arm(model: GPUModel, depth: int, reps: int, toks: torch.Tensor, device: str,
             widths: tuple[int, ...]) -> dict:
    cache = model.new_cache()
    g = torch.Generator().manual_seed(1)
    model.forward(torch.randint(model.cfg.vocab_size, (depth,), generator=g), 0, cache)
    out = {"capture_s": model.capture_s, "ms_per_round": {}}
    for W in widths:
        if device != "cuda":            # a smoke run (CPU, the interpreter): one eager round
            t0 = time.perf_counter()
            model.forward(toks[:W], depth, cache)
            cache.truncate(depth)
            out["ms_per_round"][W] = (time.perf_counter() - t0) * 1000
            continue
        graph = model.graphs[W][0]

        def replay():
            model._pos.fill_(depth)
            graph.replay()
        out["ms_per_round"][W] = time_cuda(replay, reps)
    cache.length = depth
    wide = model.forward(toks, depth, cache)[0].clone()                     # [8, V]
    cache.truncate(depth)
    alone = torch.cat([model.forward(toks[i:i + 1], depth + i, cache)[0].clone() for i in range(len(toks))])
    out["rotation_w8_equal"] = bool(torch.equal(wide, alone))
    out["logits_w8"] = wide.cpu()
    out["weight_bytes"] = model.weight_bytes
    out["cfg"] = model.cfg
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--arms", nargs="*", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (tiny presets)")
    ap.add_argument("--widths", type=int, nargs="*", default=list(WIDTHS),
                    help="round widths timed (graph buckets; 1 and 8 always added)")
    ap.add_argument("--quant", default=None, help="a mix (Q4_K_M, Q3_K_M, IQ4_XS, IQ3_XXS) or a type: the preset's by default")
    ap.add_argument("--file", default=None, help="the GGUF to write, or to reuse where it exists (kept: llama-bench reads it)")
    args = ap.parse_args()
    widths = tuple(sorted(set(args.widths) | {1, 8}))
    path = args.file or f"/tmp/arms-{args.preset}.gguf"
    if not (args.file and Path(path).exists()):
        kw = {"n_layers": args.layers} if args.layers else {}
        write_synthetic(PRESETS[args.preset](**kw, **({"quant": args.quant} if args.quant else {})), path)
    f = GGUFFile(path)
    arms = {**ARMS, **(MOE_ARMS if load_config(f).is_moe else {}), **DEFAULT_ARMS}
    if args.arms:
        arms = {k: v for k, v in arms.items() if k in args.arms}
    bw = copy_bandwidth() if args.device == "cuda" else 1e9
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "preset": args.preset,
           "quant": args.quant, "file_bytes": Path(path).stat().st_size, "layers": args.layers, "depth": args.depth, "copy_bandwidth_GBps": bw / 1e9, "arms": {}}
    toks = torch.randint(min(1000, load_config(f).vocab_size), (8,), generator=torch.Generator().manual_seed(2))
    logits = {}
    out = Path(os.environ.get("OUT", ".")) / f"gpu_decode_arms-{args.preset}{'-' + args.quant if args.quant else ''}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for name, kw in arms.items():
        try:
            r = run_arm(f, kw, args.depth, args.reps, toks, args.device, widths)
        except Exception as e:  # noqa: BLE001
            res["arms"][name] = {"error": repr(e)[:500]}
            print(f"{name}: {e!r}", flush=True)
            continue
        logits[name] = r.pop("logits_w8")
        cfg = r.pop("cfg")
        floor_ms = (r["weight_bytes"] + kv_bytes_per_token(cfg, args.depth)) / bw * 1000
        ms1 = r["ms_per_round"][1]
        r.update(floor_ms=floor_ms, tok_s_plain=1000 / ms1, share_of_floor=floor_ms / ms1,
                 w8_over_w1=r["ms_per_round"][8] / ms1, options=kw)
        base = SAME_BITS.get(name)
        if base in logits:
            r["bitwise_equal_to_" + base] = bool(torch.equal(logits[name], logits[base]))
        res["arms"][name] = r
        print(f"{name:22s} " + " ".join(f"W{W} {ms:6.3f}" for W, ms in r["ms_per_round"].items())
              + f" ms | {r['tok_s_plain']:.0f} tok/s, {100 * r['share_of_floor']:.0f}% of floor, "
                f"W8/W1 {r['w8_over_w1']:.2f}, rotation {r['rotation_w8_equal']}"
              + (f", bits = {base}'s: {r['bitwise_equal_to_' + base]}" if base in logits else ""), flush=True)
        torch.cuda.empty_cache()
        if args.device == "cuda":     # after every arm (a call's time limit may cut the rest); a CPU smoke run writes nothing
            out.write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

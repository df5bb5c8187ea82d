"""The decode options side by side, one device call: ms per round at W = 1, 2, 4, 8 for
each arm on a synthetic shape (all arms in one process, same file, same depth), the
share of the bandwidth floor, and the exactness checks at full size: every arm's W=8
rows bit-identical to the same rows run alone, and the PDL arms bit-identical to their
arm without PDL (same kernels, only the launch differs).

    GIT_COMMIT=... PYTHONUNBUFFERED=1 python bench/gpu_decode_arms.py --preset qwen3-8b [--layers N]

Arms (GPUModel keywords): f32 (qmatmul GEMVs: the control), i8 (int8-activation GEMVs,
a prepare launch per input), i8+fuse (the producers emit the int8 activations),
i8+fuse+pdl (programmatic dependent launch: the default), i8+fuse+pdl/old-tiles (the
GEMV tiles before 20261130: a same-session control), and for MoE shapes +moe_i8 (the routed experts
on int8 activations). Writes $OUT/gpu_decode_arms-*.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from gguf.constants import GGMLQuantizationType

from alphallama.bench.engine_bench import copy_bandwidth, kv_bytes_per_token, time_cuda
from alphallama.bench.hostinfo import host_state
from alphallama.gguf.arch import load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.gguf.quants import dequantize
from alphallama.kernels.attention import decode as attention
from alphallama.kernels.norm import rmsnorm as fused
from alphallama.kernels.moe import moe_i8, route as moe
from alphallama.kernels.gemv import qgemv_i8 as qgemv_i8_mod
from alphallama.kernels.gemv.qgemv_i8 import GemvTile
from alphallama.kernels.gemv.registry import DEFAULT_KERNELS
from alphallama.runtime.gpu_model import GPUModel

ARMS = {"f32": dict(decode_gemv="f32", moe_gemv="f32", fuse_q8=False, pdl=False),
        "i8": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=False, pdl=False),
        "i8+fuse": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=True, pdl=False),
        "i8+fuse+pdl": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=True, pdl=True),
        "i8+fuse+pdl/old-tiles": dict(decode_gemv="i8", moe_gemv="f32", fuse_q8=True, pdl=True, old_tiles=True)}
MOE_ARMS = {"i8+fuse+moe_i8": dict(decode_gemv="i8", moe_gemv="i8", fuse_q8=True, pdl=False),
            "i8+fuse+moe_i8+pdl": dict(decode_gemv="i8", moe_gemv="i8", fuse_q8=True, pdl=True),
            "i8+fuse+moe_i8+pdl/old-tiles": dict(decode_gemv="i8", moe_gemv="i8", fuse_q8=True, pdl=True,
                                                 old_tiles=True)}
# the defaults (config.py) and one-change variants of them: the embedding lookup in plain
# torch (~25 graph nodes, before qgemm.gather_rows), the norms at other warp counts, MoE
# routing inside gate_up (engine.fuse_route: removed 20261201), the GEMVs loading two steps ahead and the
# experts' gate_up walking gate and up rows apart, the MoE ranks summed in the next norm
# (all three: same bits), the dense gate|up GEMV with SiLU and the down's int8 input in its
# epilogue (64-row tiles, 8 or 16 warps), GEMV programs of at most 4 or 2 x rows (same bits),
# the experts' GEMVs in 16-row programs (4 rows now; moe's launches keep 4 warps), the experts'
# gate_up in 32-row programs emitting the down's int8 input (engine.moe_emit_q8: slower, removed 20261201), the GEMV
# tiles before 20261130 (W=1-leaning), routing and attention combine at other warp counts,
# the FFN norm computing the router's logits (engine.norm_router), one step of NT = all
# slots for rows of <= 64 slots (K = 2048 Q4_K: the 30B-A3B qkv and experts' gate_up; the
# dense weights' steps then all load before the PDL wait), attention tiles of 64 keys, the
# attention's old keys loaded before its PDL wait (engine.early_kv, same bits; on since 20261130
# with norm_router: the no- arms are their controls), the experts' down quantizing its own act
# (engine.moe_down_quant: slower, removed 20261201), o and down GEMVs in 2 runs of their slots
# whose partials the next norm adds (engine.gemv_split), the FFN norm's launch also routing (engine.route_in_norm:
# slower, removed 20261201), the Q4_K dense weights on the tensor cores with activations scaled a super-block
# (engine.gemv_mma: kernels/qgemv_mma.qgemv_mma_k; not the default's bits; the Q6_K weights and head too:
# slower, removed 20261201, W = 1 3.135 ms against 1.930, gpu_decode_arms-qwen3-8b-20261201-214103.json)
DEFAULT_ARMS = {"default": {}, "default/torch-embed": dict(torch_embed=True),
                "default/norm4": dict(norm_warps=4), "default/norm8": dict(norm_warps=8),
                "default/prefetch2": dict(prefetch=2),
                "default/gate-up-unpaired": dict(gate_up_paired=False),
                "default/combine-launch": dict(combine_in_norm=False),
                "default/maxbw8": dict(max_bw=8), "default/maxbw2": dict(max_bw=2),
                "default/moe-bn4": dict(moe_bn=4),
                "default/old-tiles": dict(old_tiles=True), "default/route4": dict(route_warps=4),
                "default/route2": dict(route_warps=2), "default/combine2": dict(combine_warps=2),
                "default/combine8": dict(combine_warps=8),
                "default/norm-router": dict(norm_router=True), "default/nt-short": dict(nt_short=True),
                "default/attn-bn64": dict(attn_block=64),
                "default/norm-router+nt-short": dict(norm_router=True, nt_short=True),
                "default/early-kv": dict(early_kv=True), "default/no-early-kv": dict(early_kv=False),
                "default/no-norm-router": dict(norm_router=False),
                "default/split": dict(gemv_split=True),
                "default/no-split": dict(gemv_split=False),
                # the Q4_K weights on the mma at every width (Q6_K and the head on dp4a)
                "default/mma-k": dict(gemv_mma=True, gemv_mma_narrow=0),
                # Q4_K: qgemv_q8k at W <= 4, the mma wider (the same bits); Q6_K and the head on dp4a
                "default/mma-wide": dict(gemv_mma=True, gemv_mma_narrow=4),
                "default/mma-wide1": dict(gemv_mma=True, gemv_mma_narrow=1),
                "default/mma-wide2": dict(gemv_mma=True, gemv_mma_narrow=2),
                # fast mode's hybrid (--fast; engine.fast_mma_narrow): the default's kernels up to narrow rows,
                # the mma family wider; not rotation-exact by design, W = 8 the mma family's bits
                "default/fast": dict(fast=True),
                # the same with one row group a warp at every width (qgemv_mma.mma_groups' control; the same bits)
                "default/fast-g1": dict(fast=True, mma_groups=1),
                # the same with qgemv_mma_k's two row groups a warp (session 25, untimed; the same bits)
                "default/mma-wide2-g2": dict(gemv_mma=True, gemv_mma_narrow=2, mma_groups=2),
                # Q4_K through qgemv_q8k (dp4a on q8_K activations) at every width: no tensor cores
                "default/q8k": dict(gemv_mma=True, gemv_mma_narrow=64),
                # one step a row (bench/gpu_gemv_chain.py): Q4_K rows of 4096 (and shorter) whole
                "default/row128": dict(row_step=(128, None, None)),
                "default/row128-bn8w4": dict(row_step=(128, 8, 4)),
                "default/row128-bn16w8": dict(row_step=(128, 16, 8)),
                "default/row128-bn4w4": dict(row_step=(128, 4, 4)),
                # the control of qgemv_i8.one_step_row (the per-matrix arms it came from, rows-qkv and
                # rows-qkv-o, ran at 48195f6: gpu_decode_arms-*-20261202-125520.json / -125759.json)
                "default/looped": dict(looped=True)}
# arms that must give another arm's logits bit for bit (only the launches differ)
SAME_BITS = {"default/torch-embed": "default", "default/early-kv": "default", "default/prefetch2": "default",
             "default/no-early-kv": "default",
             "default/gate-up-unpaired": "default", "default/maxbw8": "default", "default/maxbw2": "default",
             "default/combine-launch": "default", "i8+fuse+pdl": "i8+fuse",
             "default/mma-wide2-g2": "default/mma-wide2", "default/fast": "default/mma-wide2",
             "default/fast-g1": "default/fast",
             "i8+fuse+moe_i8+pdl": "i8+fuse+moe_i8"}
WIDTHS = (1, 2, 4, 8, 16)


def old_gemv_tile(w):
    """qgemv_i8's tile rule before 20261130 (4-row programs below 32768 rows): the
    control arm for the tile change, same session."""
    wide = w.qtype == GGMLQuantizationType.Q6_K and w.n_slots >= 512
    return GemvTile(BN=4 if w.N <= 32768 else 16, NT=min(64 if wide else 32, triton.next_power_of_2(w.n_slots)))


def run_arm(f: GGUFFile, kw: dict, depth: int, reps: int, toks: torch.Tensor, device: str = "cuda",
            widths: tuple[int, ...] = WIDTHS) -> dict:
    kw = dict(kw)
    saved = (qgemv_i8_mod.gemv_tile, fused.NORM_WARPS, GPUModel.embed, moe_i8.GATE_UP_PAIRED,
             qgemv_i8_mod.MAX_BW, moe_i8.EXPERT_BN, moe.ROUTE_WARPS, attention.COMBINE_WARPS, attention.BLOCK_N,
             moe_i8.step_slots, qgemv_i8_mod.one_step_row)
    groups = kw.pop("mma_groups", None)   # qgemv_mma_k's row groups a warp (not in the float order; None: its rule)
    if groups is not None:       # a registry variant the model's plans pick from (kernels/gemv/registry.py)
        kw["kernels"] = DEFAULT_KERNELS.with_mma_groups(groups)
    if kw.pop("old_tiles", False):
        qgemv_i8_mod.gemv_tile = old_gemv_tile
    steps = kw.pop("prefetch", None)
    if steps is not None:          # the same tiles, loading `steps` steps ahead (same bits)
        qgemv_i8_mod.gemv_tile = lambda w, _t=qgemv_i8_mod.gemv_tile: dataclasses.replace(_t(w), prefetch=steps)
    fused.NORM_WARPS = kw.pop("norm_warps", fused.NORM_WARPS)
    moe_i8.GATE_UP_PAIRED = kw.pop("gate_up_paired", moe_i8.GATE_UP_PAIRED)
    qgemv_i8_mod.MAX_BW = kw.pop("max_bw", qgemv_i8_mod.MAX_BW)   # x rows a program: not in the float order
    moe.ROUTE_WARPS = kw.pop("route_warps", moe.ROUTE_WARPS)                # a new float order in the softmax sums
    attention.COMBINE_WARPS = kw.pop("combine_warps", attention.COMBINE_WARPS)   # the same or a new order
    moe_i8.EXPERT_BN = kw.pop("moe_bn", moe_i8.EXPERT_BN)   # the experts' tile (a float order, the same at every W)
    attention.BLOCK_N = kw.pop("attn_block", attention.BLOCK_N)   # keys a tile and the smallest split (a float order of L)
    if kw.pop("nt_short", False):  # rows of <= 64 slots in one step (a float order of the weight alone)
        def one_step(w, _t=qgemv_i8_mod.gemv_tile):
            t = _t(w)
            return dataclasses.replace(t, NT=triton.next_power_of_2(w.n_slots)) if w.n_slots <= 64 else t
        qgemv_i8_mod.gemv_tile = one_step
        moe_i8.step_slots = lambda w, _s=moe_i8.step_slots: triton.next_power_of_2(w.n_slots) if w.n_slots <= 64 else _s(w)
    if kw.pop("looped", False):    # the control of 20261202's one-step rows: every dense tile loops
        qgemv_i8_mod.one_step_row = lambda w: False
    rows = kw.pop("row_step", None)   # (max slots, BN, warps): dense rows of <= max slots in one step, loaded
    if rows is not None:              # before the PDL wait (a float order of the weight alone; the head keeps its tile)
        def row_step(w, _t=qgemv_i8_mod.gemv_tile, most=rows[0], bn=rows[1], nw=rows[2]):
            t = _t(w)
            if w.n_slots > most or w.N > 32768:
                return t
            return dataclasses.replace(t, NT=triton.next_power_of_2(w.n_slots), BN=bn or t.BN,
                                       num_warps=nw or t.num_warps)
        qgemv_i8_mod.gemv_tile = row_step
    if kw.pop("torch_embed", False):
        emb = f.tensors["token_embd.weight"]
        raw = torch.from_numpy(emb.data.reshape(emb.shape[0], -1).view("uint8").copy()).to(device)   # [V, row_bytes]
        GPUModel.embed = lambda self, tokens: dequantize(raw[tokens], self.embd_qtype,
                                                         (tokens.shape[0], self.cfg.d_model))
    try:
        return _run_arm(f, kw, depth, reps, toks, device, widths)
    finally:
        (qgemv_i8_mod.gemv_tile, fused.NORM_WARPS, GPUModel.embed, moe_i8.GATE_UP_PAIRED,
         qgemv_i8_mod.MAX_BW, moe_i8.EXPERT_BN, moe.ROUTE_WARPS, attention.COMBINE_WARPS,
         attention.BLOCK_N, moe_i8.step_slots, qgemv_i8_mod.one_step_row) = saved


def _run_arm(f: GGUFFile, kw: dict, depth: int, reps: int, toks: torch.Tensor, device: str,
             widths: tuple[int, ...]) -> dict:
    model = GPUModel(f, 4096 if device == "cuda" else 256, device, **kw)
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
    args = ap.parse_args()
    widths = tuple(sorted(set(args.widths) | {1, 8}))
    path = f"/tmp/arms-{args.preset}.gguf"
    write_synthetic(PRESETS[args.preset](**({"n_layers": args.layers} if args.layers else {})), path)
    f = GGUFFile(path)
    arms = {**ARMS, **(MOE_ARMS if load_config(f).is_moe else {}), **DEFAULT_ARMS}
    if args.arms:
        arms = {k: v for k, v in arms.items() if k in args.arms}
    bw = copy_bandwidth() if args.device == "cuda" else 1e9
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "preset": args.preset,
           "layers": args.layers, "depth": args.depth, "copy_bandwidth_GBps": bw / 1e9, "arms": {}}
    toks = torch.randint(min(1000, load_config(f).vocab_size), (8,), generator=torch.Generator().manual_seed(2))
    logits = {}
    out = Path(os.environ.get("OUT", ".")) / f"gpu_decode_arms-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}.json"
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

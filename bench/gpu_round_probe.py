"""Would a persistent CUDA C++ layer kernel ("No Bubbles": an instruction list on the GPU,
dependency counters per tile, a producer warp streaming the next instructions' weights into
shared memory by bulk copies) beat today's PDL chain of Triton kernels? One run, both:

  chain   the real GPUModel round (synthetic Q4_K file, depth POS), W = 1 graph replays with
          LAYERS layers and with 1; the difference over LAYERS - 1 is us a layer
  kernel  kernels/cuda/round_layer.cu through NVRTC on the same shape (random Q4_K planes),
          graph replays of one launch over LAYERS and over 1 layer, the same difference;
          each variant in SPECS (--kernels) on the same layers, with waits and (dense) without
          ("nowait": the queues alone). The chains run first, so a kernel that breaks the
          CUDA context cannot take the control with it.

Checks (layer 0, every stage, from the kernel's own inputs to that stage): activations'
q8 within half a step; each GEMV against float64 (max |err| / (|W| |x|)); attention,
router, top-k and experts against float64; the qkv / o / down rows bit-compared with
qgemv_i8 on the same int8 activations (its BN 16, NT 32, 8-warp tile). Floor: a layer's
bytes over 4.0 TB/s and over the copy rate measured here. $OUT/gpu_round_probe-*.json.

    python bench/gpu_round_probe.py [--shapes qwen3-8b qwen3-30b-a3b] [--layers 5] [--kernels layer]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_layers import (HD, SHAPES, attention_ref, build, deq64, dump_size, gemv_err, make_layer,  # noqa: E402
                          quant_err, rel, rms64, rope, undump)

from alphallama.bench.engine_bench import copy_bandwidth  # noqa: E402
from alphallama.bench.hostinfo import host_state  # noqa: E402
from alphallama.kernels.cuda import nvrtc  # noqa: E402
from alphallama.kernels.cuda.schedule import NI  # noqa: E402

POS = 511                 # the new token's position: 512 keys
SMEM = 5 * 40960 + 20480  # round_layer.cu: NS * SLOT_BYTES + ACT_BYTES
FLOOR_BW = 4.0e12


@dataclass(frozen=True)
class Spec:
    """A kernel variant: source, entry, threads a CTA, CTAs an SM, dynamic shared memory,
    and an optional last integer argument (flags)."""
    src: str
    fn: str
    threads: int
    per_sm: int
    smem: int
    flags: int | None = None


SPECS = {
    "layer": Spec("round_layer.cu", "round_layer", 288, 1, SMEM),
    # session 2's round_stream.cu variants (w16d8, w16d8-nopf, -pf4, w16d16, w8d8x2, w16d8-bare; 5eeca37)
    # lost: bench/results/gpu_round_probe-h100-20261206-061236.json
}


def median_replay_us(fn, reps: int = 30) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return sorted(ts)[len(ts) // 2]


_BUILT: dict = {}   # (layers, count, xs, dumps, nowait, grid) -> uploaded queues (the layers kept alive with them)


class Probe:
    """A kernel over a list of layers: its schedule uploaded, one launch a call."""

    def __init__(self, kernel, spec: Spec, layers, xs, cs, dumps=None, nowait=False):
        """nowait: every dependency wait dropped (a timing control only: what the queues cost
        with nothing to wait for; the sums are then garbage)."""
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grid = sms * spec.per_sm
        key = (id(layers[0]), len(layers), id(xs), dumps is None, nowait, self.grid)
        if key not in _BUILT:         # the same queues for every variant of one grid
            sch = build(layers, xs, POS, cs, dumps)
            rows, starts, _ = sch.build(self.grid)
            if nowait:
                for r in rows:
                    r[1] = -1
            _BUILT[key] = (torch.tensor(rows, dtype=torch.int32, device="cuda").reshape(-1, NI),
                           torch.tensor(starts, dtype=torch.int32, device="cuda"),
                           torch.tensor(sch.ptrs, dtype=torch.int64, device="cuda"), len(sch.counters), layers)
        self.instrs, self.starts, self.ptrs, n_ctr, _ = _BUILT[key]
        self.ctr = torch.zeros(n_ctr, dtype=torch.int32, device="cuda")
        self.err = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.kernel, self.spec = kernel, spec
        self.n_instr = self.instrs.shape[0]

    def __call__(self):
        self.ctr.zero_()
        args = [self.instrs.data_ptr(), self.starts.data_ptr(), self.ctr.data_ptr(), self.err.data_ptr(),
                self.ptrs.data_ptr()]
        if self.spec.flags is not None:
            args.append(self.spec.flags)
        self.kernel.launch(self.grid, self.spec.threads, self.spec.smem, args)


def layer_bytes(L) -> int:
    s = L.s
    kv = 2 * s.KV * (POS + 1) * HD * 2
    if s.E == 0:
        return L.qkv.nbytes + L.o.nbytes + L.gate_up.nbytes + L.down.nbytes + kv
    return L.qkv.nbytes + L.o.nbytes + L.router.numel() * 4 + (L.gate_up.nbytes + L.down.nbytes) * s.topk // s.E + kv


def check(L, xs, dumps, cs, kc0, vc0) -> dict:
    """Layer 0's stages against float64 and qgemv_i8's bits."""
    from alphallama.kernels.gemv.qgemv_i8 import GemvTile, qgemv_i8
    s, out = L.s, {}
    tile = GemvTile(BN=16, NT=32, num_warps=8)

    def i8(w, name, ranks=1):
        buf = dumps[name]
        xp = buf[:w.K // 4].reshape(1, -1).contiguous()
        xsd = buf[w.K // 4:w.K // 4 + 2 * w.n_slots].reshape(1, w.n_slots, 2).contiguous()
        return qgemv_i8(torch.zeros(1, w.K, dtype=torch.bfloat16, device="cuda"), w, tile=tile,
                        prepared=(xp, xsd))[0]
    x_qkv = undump(dumps["qkv"], s.D)[0]
    out["qkv_q8_steps"] = quant_err(x_qkv, rms64(xs[0], L.norms["attn"]), s.D)
    out["qkv_err"] = gemv_err(L.buf["qkv"], x_qkv, deq64(L.qkv))
    out["qkv_bits_equal_qgemv_i8"] = bool(torch.equal(L.buf["qkv"], i8(L.qkv, "qkv")))
    a_ref, kh, vh = attention_ref(L, L.buf["qkv"], POS, cs, kc0, vc0)
    out["attn_rel"] = rel(L.buf["attn"], a_ref)
    # the new K, V as the cache holds them: fp16 of the float64 values, within one fp16 step
    out["kv_written_max_steps"] = max(((L.kc[:, POS].double() - kh.double()).abs() / (kh.double().abs() * 2 ** -10
                                       + 2 ** -24)).max().item(), (L.vc[:, POS] != vh).sum().item())
    x_o = undump(dumps["o"], s.H * HD)[0]
    out["o_q8_steps"] = quant_err(x_o, L.buf["attn"].double(), s.H * HD)
    out["o_err"] = gemv_err(xs[1], x_o, deq64(L.o), xs[0])
    out["o_bits_equal_qgemv_i8"] = bool(torch.equal(xs[1], xs[0] + i8(L.o, "o")))
    h = rms64(xs[1], L.norms["ffn"])
    x_gu = undump(dumps["gate_up"], s.D)[0]
    out["gate_up_q8_steps"] = quant_err(x_gu, h, s.D)
    if s.E == 0:
        W = deq64(L.gate_up)
        g, u = W[:s.F] @ x_gu, W[s.F:] @ x_gu
        out["gate_up_silu_rel"] = rel(L.buf["s"], g * torch.sigmoid(g) * u)
        x_d = undump(dumps["down"], s.F)[0]
        out["down_q8_steps"] = quant_err(x_d, L.buf["s"].double(), s.F)
        out["down_err"] = gemv_err(xs[2], x_d, deq64(L.down), xs[1])
        out["down_bits_equal_qgemv_i8"] = bool(torch.equal(xs[2], xs[1] + i8(L.down, "down")))
        ok = out["gate_up_silu_rel"] < 1e-5
    else:
        lg = L.router.double() @ h
        out["router_rel"] = rel(L.buf["logits"], lg)
        p = torch.softmax(L.buf["logits"].double(), 0)
        top = torch.topk(p, s.topk)
        ids = L.buf["route"][:s.topk].long()
        wts = L.buf["route"][8:8 + s.topk].view(torch.float32).double()
        out["topk_ids_equal"] = bool(torch.equal(ids, top.indices))
        out["topk_w_err"] = (wts - top.values / top.values.sum()).abs().max().item()
        sr, y = [], 0
        x_d = undump(dumps["down"], s.F, s.topk)
        for k, e in enumerate(ids.tolist()):
            W = deq64(L.gate_up, e * 2 * s.F, (e + 1) * 2 * s.F)
            g, u = W[:s.F] @ x_gu, W[s.F:] @ x_gu
            sr.append(g * torch.sigmoid(g) * u)
            y = y + wts[k] * (deq64(L.down, e * s.D, (e + 1) * s.D) @ x_d[k])
        out["experts_silu_rel"] = rel(L.buf["s"], torch.cat(sr))
        out["down_q8_steps"] = quant_err(x_d.flatten(), L.buf["s"].double(), s.F * s.topk)
        out["moe_out_rel"] = rel(xs[2].double() - xs[1].double(), y)
        ok = (out["router_rel"] < 1e-5 and out["topk_ids_equal"] and out["topk_w_err"] < 1e-5
              and out["experts_silu_rel"] < 1e-5 and out["moe_out_rel"] < 1e-5)
    steps = [v for k, v in out.items() if k.endswith("_q8_steps")]
    errs = [v for k, v in out.items() if k.endswith("_err") and not k.startswith("topk")]
    out["pass"] = bool(ok and max(steps) < 0.5 + 1e-3 and max(errs) < 1e-5 and out["attn_rel"] < 1e-5
                       and out["kv_written_max_steps"] <= 1.0)
    return out


def probe_shape(name: str, n_layers: int, kernels: dict, save=lambda res: None) -> dict:
    """Every kernel variant on the same layers: layer 0 checked (outputs poisoned first), then
    timed over n_layers and 1 layer, with waits and (dense) without."""
    s = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [make_layer(s, POS, g) for _ in range(n_layers)]
    cs = rope(POS)
    xs = [torch.randn(s.D, generator=g, device="cuda")] + [torch.full((s.D,), float("nan"), device="cuda")
                                                            for _ in range(2 * n_layers)]
    L0 = layers[0]
    ranks = s.topk if s.E else 1
    dumps = {"qkv": dump_size(L0.qkv), "o": dump_size(L0.o), "gate_up": dump_size(L0.gate_up),
             "down": dump_size(L0.down, ranks)}
    dumps = {k: torch.zeros(v, dtype=torch.int32, device="cuda") for k, v in dumps.items()}
    kc0, vc0 = L0.kc.clone(), L0.vc.clone()
    res = {"shape": s.__dict__, "layers": n_layers, "pos": POS, "bytes_per_layer": layer_bytes(L0)}
    res["floor_us_4TBps"] = res["bytes_per_layer"] / FLOOR_BW * 1e6
    for kname, (spec, kernel) in kernels.items():
        t0 = time.time()
        r = res[kname] = {"spec": spec.__dict__}
        try:
            for L in layers:
                for b in L.buf.values():
                    if b.is_floating_point():
                        b.fill_(float("nan"))
            for x in xs[1:]:
                x.fill_(float("nan"))
            for d in dumps.values():
                d.zero_()
            full = Probe(kernel, spec, layers, xs, cs, dumps)
            r["instructions"] = full.n_instr
            full()
            torch.cuda.synchronize()
            r["err_flag"] = int(full.err.item())
            r["finite_last"] = bool(torch.isfinite(xs[-1]).all())
            try:
                r["check"] = check(L0, xs, dumps, cs, kc0, vc0)
            except Exception as e:  # noqa: BLE001
                r["check"] = {"error": traceback.format_exc()[-2000:]}
                print(f"{kname} check failed: {e!r}", flush=True)
            del full
            t_full = median_replay_us(Probe(kernel, spec, layers, xs, cs))
            t_one = median_replay_us(Probe(kernel, spec, layers[:1], xs, cs))
            r["us"] = {"all_layers": t_full, "one_layer": t_one, "per_layer": (t_full - t_one) / (n_layers - 1)}
            if s.E == 0:      # the same queues with no waits (routing would read garbage ids: dense only)
                nw_full = median_replay_us(Probe(kernel, spec, layers, xs, cs, nowait=True))
                nw_one = median_replay_us(Probe(kernel, spec, layers[:1], xs, cs, nowait=True))
                r["us"]["nowait_per_layer"] = (nw_full - nw_one) / (n_layers - 1)
                r["nowait_TBps"] = res["bytes_per_layer"] / r["us"]["nowait_per_layer"] / 1e6
            r["TBps"] = res["bytes_per_layer"] / r["us"]["per_layer"] / 1e6
        except Exception as e:  # noqa: BLE001
            r["error"] = traceback.format_exc()[-3000:]
            print(f"{name} {kname}: {e!r}", flush=True)
        r["wall_s"] = time.time() - t0
        print(f"{name} {kname}: {r.get('us')} err {r.get('err_flag')} pass {r.get('check', {}).get('pass')} "
              f"({r['wall_s']:.1f} s)", flush=True)
        save(res)
    del layers
    _BUILT.clear()
    torch.cuda.empty_cache()
    return res


def chain_shape(name: str, n_layers: int) -> dict:
    """The real GPUModel round (defaults: qgemv_i8, fused producers, PDL) at W = 1."""
    from alphallama.gguf.reader import GGUFFile
    from alphallama.gguf.writer import PRESETS, write_synthetic
    from alphallama.runtime.capture import collector_paused
    from alphallama.runtime.gpu_model import GPUModel
    path = f"/tmp/round-probe-{name}.gguf"
    t0 = time.time()
    write_synthetic(PRESETS[name](n_layers=n_layers, vocab_size=8192, quant="Q4_K"), path)
    model = GPUModel(GGUFFile(path), POS + 65, "cuda", graphs=False)
    cache = model.new_cache()
    cache.k.normal_()
    cache.v.normal_()
    model._pos.fill_(POS)
    every = list(model.layers)
    out = {"write_load_s": time.time() - t0}
    for n in (n_layers, 1):
        model.layers = every[:n]
        with torch.inference_mode(), collector_paused(collect=True):
            out[f"us_{n}"] = median_replay_us(lambda: model._rows(model._tokens[:1], model._pos, cache))
    model.layers = every
    out["per_layer"] = (out[f"us_{n_layers}"] - out["us_1"]) / (n_layers - 1)
    out["bytes_per_layer"] = every[1].qkv.nbytes + every[1].o.nbytes + (
        every[1].gate_up.nbytes + every[1].down.nbytes if every[1].moe is None else every[1].moe.nbytes)
    model.layers = cache = None
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--kernels", nargs="*", default=list(SPECS))
    ap.add_argument("--no-chain", action="store_true")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    res = {"host": host_state(sys.argv), "commit": os.environ.get("GIT_COMMIT"), "gpu": props.name,
           "sms": props.multi_processor_count, "command": " ".join(sys.argv), "copy_bandwidth_GBps": copy_bandwidth() / 1e9,
           "shapes": {}}
    path = Path(os.environ.get("OUT", ".")) / f"gpu_round_probe-{time.strftime('%Y%m%d-%H%M%S')}.json"
    t0 = time.time()
    kernels, res["compile_s"], res["attributes"] = {}, {}, {}
    for k in args.kernels:
        spec = SPECS[k]
        t1 = time.time()
        try:
            kernels[k] = (spec, nvrtc.load(spec.src, spec.fn))
            res["attributes"][k] = nvrtc.attributes(kernels[k][1], spec.threads, spec.smem)
        except Exception as e:  # noqa: BLE001
            res["attributes"][k] = {"error": traceback.format_exc()[-3000:]}
            print(f"{k}: {e!r}", flush=True)
        res["compile_s"][k] = time.time() - t1
        if k in kernels and res["attributes"][k].get("blocks_per_sm", 0) < spec.per_sm:   # not co-resident: skip
            print(f"{k}: {res['attributes'][k]} fits fewer than {spec.per_sm} CTAs an SM: skipped", flush=True)
            del kernels[k]
    print(f"compiled: {res['compile_s']} {res['attributes']}", flush=True)
    for name in args.shapes:       # the controls first: a kernel that breaks the context cannot take them along
        r = res["shapes"][name] = {}
        if not args.no_chain:
            try:
                r["chain"] = chain_shape(name, args.layers)
            except Exception as e:  # noqa: BLE001
                r["chain"] = {"error": traceback.format_exc()[-3000:]}
                print(f"{name} chain: {e!r}", flush=True)
            print(f"{name} chain: {r['chain'].get('per_layer')} us/layer ({time.time() - t0:.0f} s)", flush=True)
            path.write_text(json.dumps(res, indent=1, default=str))
    for name in args.shapes:
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        r = res["shapes"][name]

        def save(kres, r=r):
            r["kernel"] = kres
            path.write_text(json.dumps(res, indent=1, default=str))
        try:
            save(probe_shape(name, args.layers, kernels, save))
        except Exception as e:  # noqa: BLE001     # keep the variants already measured
            save({**r.get("kernel", {}), "error": traceback.format_exc()[-3000:]})
            print(f"{name} kernel: {e!r}", flush=True)
    print(f"{res['gpu']} copy {res['copy_bandwidth_GBps']:.0f} GB/s; total {time.time() - t0:.0f} s", flush=True)
    for name, v in res["shapes"].items():
        k, c = v.get("kernel", {}), v.get("chain", {})
        print(f"{name}: chain {c.get('per_layer')} us/layer, floor(4 TB/s) {k.get('floor_us_4TBps')}", flush=True)
        for kn in args.kernels:
            kr = k.get(kn, {})
            print(f"  {kn:12s} {kr.get('us')} pass {kr.get('check', {}).get('pass')} err {kr.get('err_flag')} "
                  f"TB/s {kr.get('TBps')} nowait TB/s {kr.get('nowait_TBps')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

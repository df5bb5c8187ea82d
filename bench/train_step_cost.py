"""The embedded model's training step, before and after the chunked cross-entropy and the
MTP position subset (train/ce.py): FLOPs and logit bytes estimated for the real shape,
and a CPU step timed at a small shape as a sanity check (CPU times are not GPU times).

    python bench/train_step_cost.py [--steps 6] [-o bench/results/train_step_cost-cpu-DATE.json]
    python3 bench/train_step_cost.py --device cuda --steps 8 -o step_ab.json   # the real shape, A/B
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from alphallama.config import DEFAULTS
from alphallama.train.loop import losses
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead

T_ = DEFAULTS.train
# bytes of traffic a logit. Plain: bf16 logits written (2), .float() (2 + 4), log-softmax
# (4 + 4, kept), nll backward's dense float32 gradient (4), log-softmax backward (4 + 4 + 4),
# the cast to bf16 (4 + 2), two products read it (2 + 2): 42. Chunked (ce.py): logits (2),
# log_softmax(dtype=float32) of bf16 converts first (ATen fuses only half: 2 + 4, then 4 + 4),
# exp_ in place (4 + 4), the cast (4 + 2), two products (2 + 2): 34
BYTES_PLAIN, BYTES_CHUNKED = 42, 34
# an H200 assumed for the time estimate: bf16 products at ~60% of 790 TFLOP/s, ~3.5 TB/s
FLOPS_S, BYTES_S = 0.6 * 790e12, 3.5e12
STEP_S_BEFORE = 64 * 1024 / 285e3        # the shipped run: ~285k tokens/s at batch 64 (train-embedded-20261203)


def step_cost(B: int, T: int, V: int, D: int, L: int, H: int, KV: int, hd: int, E: int, k: int, Fe: int,
              Fm: int, depths: int, mtp_frac: float, chunked: bool) -> dict:
    """FLOPs of one step (forward + backward = 3x forward) by part, and the bytes of the
    logits' elementwise work (the part ce.py changes; the rest is the same before/after)."""
    N, Q, KVd = B * T, H * hd, KV * hd
    proj = 2 * (D * Q + 2 * D * KVd + Q * D)
    trunk = L * (proj + 2 * T * Q + 2 * k * 3 * D * Fe + 2 * D * E)          # causal attention: half of 4*T*Q
    mtp_block = sum(2 * 2 * D * D + proj + 2 * 3 * D * Fm + (2 * T * Q if d == 1 else 4 * d * T * Q)
                    for d in range(1, depths + 1))                           # depth >1: masked, no skipping
    head = 2 * D * V
    rows_main, rows_mtp = N, sum(round(mtp_frac * B * (T - 1 - d)) for d in range(1, depths + 1))
    fl = {"trunk": 3 * N * trunk, "mtp_block": 3 * N * mtp_block, "main_logits": 3 * rows_main * head,
          "mtp_logits": 3 * rows_mtp * head}
    per = BYTES_CHUNKED if chunked else BYTES_PLAIN
    logit_bytes = (rows_main + rows_mtp) * V * per
    logit_s = (fl["main_logits"] + fl["mtp_logits"]) / FLOPS_S + logit_bytes / BYTES_S
    return {"flops": {k_: round(v / 1e12, 2) for k_, v in fl.items()} | {"total": round(sum(fl.values()) / 1e12, 2)},
            "logit_rows": rows_main + rows_mtp, "logit_bytes_GB": round(logit_bytes / 1e9, 1),
            # float32 log-softmax kept for backward (plain); ce.py keeps [N, D] and [V, D] gradients
            "logits_kept_for_backward_GB": 0.0 if chunked else round((rows_main + rows_mtp) * V * 4 / 1e9, 1),
            "logit_time_est_ms": round(1e3 * logit_s, 1)}


def estimate() -> dict:
    c = {"B": T_.batch_size, "T": T_.ctx_len, "V": T_.vocab_size, "D": T_.d_model, "L": T_.n_layers,
         "H": T_.n_heads, "KV": T_.n_kv_heads, "hd": T_.head_dim, "E": T_.n_experts, "k": T_.n_experts_used,
         "Fe": T_.d_ff_expert, "Fm": T_.mtp_d_ff, "depths": T_.mtp_depths}
    before = step_cost(**c, mtp_frac=1.0, chunked=False)
    after = step_cost(**c, mtp_frac=T_.mtp_frac, chunked=True)
    saved = (before["logit_time_est_ms"] - after["logit_time_est_ms"]) / 1e3
    est = STEP_S_BEFORE / (STEP_S_BEFORE - saved)
    return {"shape": c, "before": before, "after": after | {"mtp_frac": T_.mtp_frac, "ce_chunk": T_.ce_chunk},
            "assumed": {"bf16_flops_per_s": FLOPS_S, "bytes_per_s": BYTES_S, "step_s_before": round(STEP_S_BEFORE, 4),
                        "bytes_per_logit": {"plain": BYTES_PLAIN, "chunked": BYTES_CHUNKED}},
            "est_step_speedup": round(est, 3)}


SMALL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "n_experts": 4,
         "n_experts_used": 2, "d_ff_expert": 64, "ctx_len": 256, "batch": 8, "mtp_d_ff": 256}
REAL = {"d_model": T_.d_model, "n_layers": T_.n_layers, "n_heads": T_.n_heads, "n_kv_heads": T_.n_kv_heads,
        "head_dim": T_.head_dim, "n_experts": T_.n_experts, "n_experts_used": T_.n_experts_used,
        "d_ff_expert": T_.d_ff_expert, "ctx_len": T_.ctx_len, "batch": T_.batch_size, "mtp_d_ff": T_.mtp_d_ff}


def time_steps(device: str, shape: dict, steps: int, chunk: int, frac: float) -> dict:
    """Median seconds of a forward + backward + AdamW step (random tokens, the real
    vocabulary) after one warm-up step; the peak memory on CUDA."""
    torch.manual_seed(0)
    sh = dict(shape)
    batch, mtp_ff = sh.pop("batch"), sh.pop("mtp_d_ff")
    cfg = MoEConfig(vocab_size=T_.vocab_size, **sh)
    model, head = MoEModel(cfg).to(device), MTPHead(MTPConfig.from_model(cfg.model_config(), mtp_ff)).to(device)
    params = [p for m in (model, head) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.ctx_len + 1), device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(i)
        main, mtp, aux, _, _ = losses(model, head, x, 3, device, chunk=chunk, mtp_frac=frac, generator=g)
        loss = main + 0.3 * sum(mtp) / 3 + 0.01 * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    out = {"median_s": round(med, 4), "all_s": [round(t, 4) for t in times[1:]],
           "tokens_per_s": round(batch * cfg.ctx_len / med), "shape": shape}
    if cuda:
        out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    del model, head, opt
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", choices=["small", "real"], default=None, help="default: real on CUDA, small on CPU")
    p.add_argument("-o", "--output", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    shape = {"small": SMALL, "real": REAL}[a.shape or ("real" if a.device.startswith("cuda") else "small")]
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor() or platform.machine()
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": dev,
           "torch": torch.__version__, "estimate_real_shape": estimate()}
    runs: dict = {}
    for _ in range(2):    # interleaved twice: a shared machine drifts
        for name, chunk, frac in (("before", 0, 1.0), ("after", T_.ce_chunk, T_.mtp_frac)):
            try:
                runs.setdefault(name, []).append(time_steps(a.device, shape, a.steps, chunk, frac))
            except torch.cuda.OutOfMemoryError as e:
                runs.setdefault(name, []).append({"error": f"out of memory: {e}"[:200]})
                torch.cuda.empty_cache()
    best = {k: min((r for r in v if "median_s" in r), key=lambda r: r["median_s"], default=None) for k, v in runs.items()}
    out["timed"] = {"device": a.device, "best": best, "runs": runs,
                    "note": "random tokens; median of each run, the best of two interleaved runs"
                            + ("" if a.device.startswith("cuda") else f"; CPU, threads={a.threads}, a small shape: "
                               "a sanity check, not GPU times")}
    if all(best.values()):
        out["timed"]["after_over_before_speed"] = round(best["before"]["median_s"] / best["after"]["median_s"], 3)
    print(json.dumps({k: out[k] for k in ("host", "timed")} | {"est_step_speedup": out["estimate_real_shape"]
                                                                ["est_step_speedup"]}, indent=1)[:3000])
    if a.output:
        with open(a.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

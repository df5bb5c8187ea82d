"""What it costs to leave a hybrid's recurrent state at the accepted prefix of a verify round,
on the CPU reference: per-row snapshots against replay (hybrid_cache.py).

A round runs W rows through every recurrent layer's delta rule. Then either
  snapshot: a copy of every layer's (conv, ssm) state was kept after each row; the commit
            copies the accepted row's state back;
  replay:   the round's recurrence inputs were kept; the commit restores the state from
            before the round and runs the delta rule again over the 1 + n_acc accepted rows.
Both are timed (median of reps) beside the round's own recurrence, at the recurrent shape of
the Qwen3.6-35B-A3B-like preset (30 DeltaNet layers, 32 value heads of 128, conv width 4),
one thread, process CPU time (the machine is shared). The projections, attention and FFN are the same in both and are not timed.

    PYTHONPATH=src python bench/hybrid_state_commit.py [--layers 30] [-o bench/results/hybrid-state-commit-cpu.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from alphallama.model.deltanet import RecurrentInputs, delta_rule, replay


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.process_time()      # CPU time: the machine is shared, wall time measures the others
        fn()
        ts.append(1000 * (time.process_time() - t0))
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv-dim", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-o", "--out", default="bench/results/hybrid-state-commit-cpu.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    L, H, d, C = a.layers, a.heads, a.head_dim, a.conv_dim
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(L, 3, C, generator=g)
    ssm = 0.1 * torch.randn(L, H, d, d, generator=g)
    rows = []
    for W in (1, 2, 4, 8, 16):
        q = torch.nn.functional.normalize(torch.randn(W, H, d, generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(W, H, d, generator=g), dim=-1)
        v, gg = torch.randn(W, H, d, generator=g), -torch.rand(W, H, generator=g)
        beta, mix = torch.rand(W, H, generator=g), torch.randn(W, C, generator=g)
        inputs = RecurrentInputs(mix, q, k, v, gg, beta)

        def round_plain():
            for j in range(L):
                delta_rule(q, k, v, gg, beta, ssm[j])

        def round_snapshots():
            for j in range(L):
                states: list[torch.Tensor] = []
                delta_rule(q, k, v, gg, beta, ssm[j], states)
                for t in range(W):
                    torch.cat([conv[j], mix[:t + 1]])[-3:].clone()
        pre = (conv.clone(), ssm.clone())
        out = {"W": W, "round_ms": _median_ms(round_plain, a.reps),
               "round_with_snapshots_ms": _median_ms(round_snapshots, a.reps),
               "snapshot_commit_ms": _median_ms(lambda: (conv.copy_(pre[0]), ssm.copy_(pre[1])), a.reps),
               "replay_commit_ms": {}}
        for n in sorted({1, (W + 1) // 2, W}):
            def commit_replay():
                conv.copy_(pre[0])
                ssm.copy_(pre[1])
                for j in range(L):
                    replay(inputs, n, conv[j], ssm[j])
            out["replay_commit_ms"][n] = _median_ms(commit_replay, a.reps)
        print(out)
        rows.append(out)
    res = {"what": __doc__.split("\n\n")[0], "shape": {"layers": L, "heads": H, "head_dim": d, "conv_dim": C},
           "machine": platform.processor() or platform.machine(), "torch_threads": 1, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The expert store's admission at -np N: does a budget per round, sized for one stream's
rounds, let the bank follow N streams, or must each stream bring its own?

The store's own bookkeeping (offload/store.py: the usage policy, the chosen admissions,
their chunked copies and publication; on the CPU its "bank" is ordinary memory, the
bookkeeping the device's) driven round by round by N streams' synthetic routing, no model
forward: before_round, the round's picks written into `routes`, after_launch(W, streams).

Routing (each stream, each layer): a topic's preference over the E experts, a Zipf law
(exponent --zipf) over a random order of them, mixed with a global Zipf law all topics share
(--shared of the mass: experts every context uses); a row picks k experts without
replacement in proportion (Plackett-Luce through Gumbel keys). A stream moves to a fresh
topic with probability 1 / --topic-tokens a token (its context drifts); the streams' topics
are independent. One row a stream a round (plain decode). The trace is made once per N and
replayed for every arm, so the arms differ in their budget alone:

  - round:     --budget experts' bytes a round (one stream's sizing: today's rule at -np N),
  - stream:    --budget a stream of the round (admission.round_budget),
  - unbounded: 64 x that (the policy's ceiling when copies are free).

Reported per (N, arm), after --warmup rounds: the hit rate of the picks, admissions and
admitted experts per round and per token. Admitted bytes are what the device pays for
(PCIe time beside the round's own reads), so "unbounded" is no proposal: it shows how much
hit rate is left on the table. Writes $OUT/offload_streams_admission-<date>.json.

    python bench/offload_streams_admission.py [--ns 1 2 4] [--rounds 3000]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import SyntheticSpec, uniform_mix, write_synthetic
from alphallama.offload.store import ExpertStore
from alphallama.runtime.weights import BlockNames

ARMS = {"round": lambda n: 1, "stream": lambda n: n, "unbounded": lambda n: 64 * n}


def store_file(path: str, layers: int, experts: int) -> str:
    """A tiny qwen3moe whose experts (Q8_0, ~13 KiB each) the store holds: only their count matters."""
    from gguf.constants import GGMLQuantizationType as T
    spec = SyntheticSpec(arch="qwen3moe", name="admission-sim", n_layers=layers, d_model=64, n_heads=2,
                         n_kv_heads=1, head_dim=32, d_ff=128, n_experts=experts, n_experts_used=2, d_ff_expert=64,
                         vocab_size=260, ctx_len=256, quant=uniform_mix(T.Q8_0), seed=1)
    write_synthetic(spec, path)
    return path


def trace(n: int, rounds: int, layers: int, experts: int, k: int, zipf: float, shared: float,
          topic_tokens: float, seed: int) -> np.ndarray:
    """-> [rounds, layers, n, k] int32: each round's picks, stream by stream (the pass's row order)."""
    rng = np.random.default_rng(seed)
    law = 1.0 / np.arange(1, experts + 1) ** zipf
    law /= law.sum()                                                            # [E] by rank
    glob = np.stack([law[rng.permutation(experts)] for _ in range(layers)])      # [L, E]

    def topic() -> np.ndarray:                                                  # [L, E]
        t = np.stack([law[rng.permutation(experts)] for _ in range(layers)])
        return np.log(shared * glob + (1.0 - shared) * t)
    logp = np.stack([topic() for _ in range(n)])                                # [n, L, E]
    out = np.empty((rounds, layers, n, k), dtype=np.int32)
    for r in range(rounds):
        for s in np.nonzero(rng.random(n) < 1.0 / topic_tokens)[0]:
            logp[s] = topic()
        keys = logp + rng.gumbel(size=logp.shape)                               # [n, L, E]
        top = np.argpartition(-keys, k - 1, axis=2)[:, :, :k]                   # [n, L, k]
        out[r] = top.transpose(1, 0, 2)
    return out


def run_arm(layers_info: dict, experts: int, picks: np.ndarray, slots: int, budget: int, streams: int,
            warmup: int) -> dict:
    """Replay `picks` [R, L, n, k] through a fresh store whose one-stream budget is `budget`
    bytes, each round of n rows passed to after_launch as carrying `streams` streams (the arm's rule)."""
    R, L, n, k = picks.shape
    s = ExpertStore(layers_info, L, experts, k, slots, "cpu", 64, admit_bytes_per_round=budget,
                    chunk_bytes=budget)
    slot_bytes = s.classes[0].slot_bytes
    t0 = time.perf_counter()
    base = s.stats.to_dict()
    for r in range(R):
        s.before_round()                       # (round r - 1's picks observed)
        if r == warmup:
            base = s.stats.to_dict()
        s.routes[:, :n] = torch.from_numpy(picks[r])
        s.after_launch(n, streams)
    s.before_round()
    st = s.stats.to_dict()
    rounds = R - warmup
    lookups, hits = st["lookups"] - base["lookups"], st["hits"] - base["hits"]
    admissions = st["admissions"] - base["admissions"]
    admitted = (st["admitted_bytes"] - base["admitted_bytes"]) / slot_bytes
    return {"hit_rate": hits / lookups, "admissions_per_round": admissions / rounds,
            "admissions_per_token": admissions / (rounds * n), "admitted_experts_per_round": admitted / rounds,
            "seconds": time.perf_counter() - t0}


def measure(ns=(1, 2, 4), rounds: int = 3000, warmup: int = 500, layers: int = 4, experts: int = 64, k: int = 4,
            bank: float = 0.25, budget_experts: float = 0.25, zipf: float = 1.1, shared: float = 0.3,
            topic_tokens: float = 150.0, seed: int = 0, arms=tuple(ARMS), path: str | None = None) -> dict:
    """Every (N, arm) of the module docstring -> {"runs": [...], "settings": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        f = GGUFFile(store_file(path or os.path.join(tmp, "sim.gguf"), layers, experts))
        info = {i: tuple(f.tensors[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(layers)}
        probe = ExpertStore(info, layers, experts, k, 1, "cpu", 64)
        slot_bytes = probe.classes[0].slot_bytes
        budget = max(1, int(budget_experts * slot_bytes))
        slots = int(bank * layers * experts)
        runs = []
        for n in ns:
            picks = trace(n, rounds, layers, experts, k, zipf, shared, topic_tokens, seed + n)
            for arm in arms:
                r = run_arm(info, experts, picks, slots, budget, ARMS[arm](n), warmup)
                runs.append({"N": n, "arm": arm, **r})
    settings = {"rounds": rounds, "warmup": warmup, "layers": layers, "experts": experts, "k": k, "bank": bank,
                "budget_experts": budget_experts, "zipf": zipf, "shared": shared, "topic_tokens": topic_tokens,
                "seed": seed, "slot_bytes": slot_bytes, "slots": slots}
    return {"settings": settings, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--bank", type=float, default=0.25, help="bank slots as a share of all experts")
    ap.add_argument("--budget", type=float, default=0.25, help="one stream-round's admission budget, in experts")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--shared", type=float, default=0.3, help="share of the routing every topic has in common")
    ap.add_argument("--topic-tokens", type=float, default=150.0, help="a stream's mean tokens on one topic")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res = measure(args.ns, args.rounds, args.warmup, args.layers, args.experts, args.k, args.bank, args.budget,
                  args.zipf, args.shared, args.topic_tokens, args.seed)
    res["argv"] = sys.argv
    out = Path(os.environ.get("OUT", ".")) / f"offload_streams_admission-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"{'N':>3} {'arm':>10} {'hit rate':>9} {'adm/round':>10} {'adm/token':>10} {'copied/round':>13}")
    for r in res["runs"]:
        print(f"{r['N']:>3} {r['arm']:>10} {r['hit_rate']:9.3f} {r['admissions_per_round']:10.3f} "
              f"{r['admissions_per_token']:10.3f} {r['admitted_experts_per_round']:13.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

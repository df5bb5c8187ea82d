"""MTP head quality with the engine, teacher-forced over held-out code: the conditional
hit rate at depths 1..d, chain survival, and calibration (the head's top-1 probability,
binned, against the measured hit rate).

For each code file the main model runs over its tokens once (KV cache + hidden states)
and the MTP head makes its depth-1 entries for every position. Then, at positions n
every `--stride` tokens (from the end backwards, so a round only ever overwrites cache
rows of positions not yet visited), a round runs exactly as the engine runs it: the
head's chain of d drafts from position n (no min-p stop), one verify pass over
[x_n, d_1..d_d], greedy acceptance. Draft k is "examined" when drafts 1..k-1 were
accepted; the conditional hit rate at k is hits / examined. The summary also gives what
the engine's min-p stop would make of the same rounds (drafts verified and tokens
committed per round) and the wall time of a chain and of a verify round.

    python bench/mtp_quality.py MODEL.gguf [--draft-head HEAD.gguf] --code-dir DIR [--device cuda]

Writes mtp_quality-<model>-<date>.json and .png under --out (default bench/results, or
$OUT). Runs on CPU (small models) and CUDA.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from alphallama.bench.hostinfo import host_state
from alphallama.config import DEFAULTS
from alphallama.engine import Engine

BINS = [i / 10 for i in range(11)]


def _corpus_rule(sha: str, text: str, frac: float) -> bool:
    from alphallama.train.corpus import held_out
    return held_out(sha, frac)


# --held-out-rule: how a trainer chose the files it never trained on, by content hash.
# The MTP distillation collects its corpus with the same module and rule (at its own
# fraction), so both names map to one function.
HELD_OUT_RULES = {"corpus": _corpus_rule, "distill": _corpus_rule}


def code_files(root: str, n: int, held_out: float | None, rule: str = "corpus",
               min_bytes: int = 512) -> list[tuple[str, str, str]]:
    """(path, sha256, text) of up to n .py files under root, in sha256 order (a fixed
    pseudo-random pick); held_out: keep only the files a trainer holds out at that
    fraction, by its rule (the embedded model's corpus, or the MTP distillation's)."""
    out = []
    for p in sorted(Path(root).rglob("*.py")):
        try:
            data = p.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(data) < min_bytes:
            continue
        sha = hashlib.sha256(data).hexdigest()
        if held_out is not None and not HELD_OUT_RULES[rule](sha, text, held_out):
            continue
        out.append((str(p), sha, text))
    out.sort(key=lambda t: t[1])
    return out[:n]


def jsonl_files(path: str, n: int, min_bytes: int = 512) -> list[tuple[str, str, str]]:
    """The same from a JSON-lines file (.gz too) of {"path", "sha256", "text"}: the
    held-out split the embedded model's trainer writes (heldout.jsonl.gz)."""
    import gzip
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = [(r["path"], r["sha256"], r["text"]) for r in rows if len(r["text"].encode()) >= min_bytes]
    out.sort(key=lambda t: t[1])
    return out[:n]


class Timer:
    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.ms: dict[str, list[float]] = {}

    def __call__(self, name, fn, *a):
        self.sync()
        t0 = time.perf_counter()
        out = fn(*a)
        self.sync()
        self.ms.setdefault(name, []).append(1000 * (time.perf_counter() - t0))
        return out


def measure_file(eng: Engine, ids: list[int], depth: int, stride: int, first: int, timer: Timer,
                 exact: bool = True) -> list[dict]:
    """Rounds at positions first.., every `stride`, of one file: per round the chain's
    probabilities and how many drafts the verify pass accepted."""
    model, cache, state = eng.model, eng.cache, eng.mtp
    head, mcache = state.head, state.cache
    T = len(ids)
    eng.reset()
    toks = torch.tensor(ids)
    _, hidden = model.forward(toks, 0, cache, logits=False)
    hidden = hidden.clone()                                                  # [T, D] (graph outputs are reused)
    g = torch.cat([torch.zeros(1, hidden.shape[1], device=hidden.device), hidden[:-1]])   # g of entry p
    head.extend(g, toks, 0, mcache)
    rounds = []
    for n in range(T - 1, first - 1, -stride):
        mcache.truncate(n)
        drafts, probs = timer("chain", head.draft, g[n:n + 1], toks[n:n + 1], n, depth, mcache)
        cache.truncate(n)
        logits, _ = timer(f"verify_w{1 + depth}", model.verify, torch.tensor([ids[n], *drafts]), n, cache, exact)
        best = logits.argmax(-1).tolist()
        acc = 0
        while acc < depth and drafts[acc] == best[acc]:
            acc += 1
        rounds.append({"pos": n, "probs": probs, "accepted": acc})
        if len(rounds) % 8 == 1:                                             # the W = 1 round, for scale
            cache.truncate(n)
            timer("verify_w1", model.verify, torch.tensor([ids[n]]), n, cache, exact)
    return rounds


def summarize(rounds: list[dict], depth: int, min_p: float) -> dict:
    reached, hits = [0] * depth, [0] * depth
    cal = [[[0, 0.0, 0] for _ in BINS[:-1]] for _ in range(depth)]       # [depth][bin] -> n, sum p, hits
    for r in rounds:
        for k in range(min(depth, r["accepted"] + 1)):                    # examined: 1..k-1 accepted
            hit = k < r["accepted"]
            reached[k] += 1
            hits[k] += hit
            b = min(int(r["probs"][k] * 10), 9)
            cell = cal[k][b]
            cell[0] += 1
            cell[1] += r["probs"][k]
            cell[2] += hit
    cond = [h / n if n else 0.0 for h, n in zip(hits, reached)]
    surv, s = [], 1.0
    for c in cond:
        s *= c
        surv.append(s)
    proposed = accepted = 0
    for r in rounds:                                                      # the engine's min-p stop
        m = 0
        while m < depth and r["probs"][m] >= min_p:
            m += 1
        proposed += m
        accepted += min(m, r["accepted"])
    n = max(len(rounds), 1)
    return {
        "rounds": len(rounds), "reached": reached, "hits": hits,
        "conditional_hit_rate": cond, "chain_survival": surv,
        "tokens_per_round_no_stop": 1 + sum(r["accepted"] for r in rounds) / n,
        "min_p": min_p, "drafts_per_round_at_min_p": proposed / n,
        "tokens_per_round_at_min_p": 1 + accepted / n,
        "calibration": [[{"bin": [BINS[b], BINS[b + 1]], "n": c[0], "mean_p": c[1] / c[0] if c[0] else None,
                          "hit_rate": c[2] / c[0] if c[0] else None} for b, c in enumerate(row)] for row in cal],
    }


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depth = len(summary["conditional_hit_rate"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = list(range(1, depth + 1))
    a.plot(ks, summary["conditional_hit_rate"], "o-", label="conditional hit rate")
    a.plot(ks, summary["chain_survival"], "s--", label="chain survival")
    a.set_xticks(ks)
    a.set_ylim(0, 1)
    a.set_xlabel("draft depth k")
    a.set_title("MTP drafts vs the model's greedy token")
    a.legend()
    b.plot([0, 1], [0, 1], color="grey", lw=0.8)
    for k, row in enumerate(summary["calibration"], start=1):
        pts = [(c["mean_p"], c["hit_rate"], c["n"]) for c in row if c["n"]]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"depth {k}",
                   markersize=3)
    b.set_xlabel("head's top-1 probability (bin mean)")
    b.set_ylabel("measured hit rate")
    b.set_title("calibration (examined drafts)")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft-head", default=None)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--code-dir", help="held-out Python code (searched recursively)")
    src.add_argument("--code-jsonl", help="held-out files as JSON lines (path, sha256, text), e.g. heldout.jsonl.gz")
    ap.add_argument("--held-out-fraction", type=float, default=None,
                    help="keep only files held out of training by content hash at this fraction")
    ap.add_argument("--held-out-rule", default="corpus", choices=list(HELD_OUT_RULES),
                    help="whose hash rule: the embedded model's corpus (train/corpus.py) or the MTP "
                         "distillation's (train/distill_data.py)")
    ap.add_argument("--files", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per file (its start)")
    ap.add_argument("--stride", type=int, default=4, help="positions between measured rounds")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--min-p", type=float, default=0.5, help="for the summary of what the engine would verify")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fast", action="store_true",
                    help="batched verify on the CPU reference (may differ from exact mode in near-ties; "
                         "the GPU runtime's verify is the same either way)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    if not 1 <= args.depth <= DEFAULTS.mtp.max_depth:
        ap.error(f"--depth must be in 1..{DEFAULTS.mtp.max_depth}")

    host = host_state(sys.argv)
    t0 = time.perf_counter()
    eng = Engine.load(args.model, ctx_size=args.tokens + 2 * DEFAULTS.mtp.max_depth + 8, device=args.device,
                      draft_head=args.draft_head)
    if eng.mtp is None:
        print(f"error: {args.model} has no MTP head (give --draft-head)", file=sys.stderr)
        return 2
    eng.mtp.choose_vocab(eng.encode_prompt("def f():\n    return 1\n"))    # code: the Latin subset
    prepare = getattr(eng.mtp.head, "prepare", None)
    if prepare is not None:
        prepare(args.depth, eng.mtp.cache)
    load_s = time.perf_counter() - t0
    if args.code_jsonl:
        files = jsonl_files(args.code_jsonl, args.files)
    else:
        files = code_files(args.code_dir, args.files, args.held_out_fraction, args.held_out_rule)
    if not files:
        print(f"error: no Python files of 512+ bytes in {args.code_dir or args.code_jsonl}", file=sys.stderr)
        return 2
    timer = Timer(eng.cache.k.device)
    rounds, used = [], []
    for path, sha, text in files:
        ids = eng.tokenizer.encode(text, add_special=True)[:args.tokens]
        if len(ids) < 64:
            continue
        rs = measure_file(eng, ids, args.depth, args.stride, 16, timer, exact=not args.fast)
        rounds += rs
        rel = os.path.relpath(path, args.code_dir) if args.code_dir else path
        used.append({"path": rel, "sha256": sha, "tokens": len(ids), "rounds": len(rs)})
        s = summarize(rs, args.depth, args.min_p)
        print(f"{used[-1]['path'][:50]:50} {len(ids):5d} tok  cond "
              + " ".join(f"{c:.2f}" for c in s["conditional_hit_rate"]), flush=True)
    summary = summarize(rounds, args.depth, args.min_p)
    timings = {k: {"n": len(v), "mean_ms": sum(v) / len(v), "min_ms": min(v)} for k, v in timer.ms.items()}
    vocab = eng.mtp.head.vocab_ids
    result = {
        "bench": "mtp_quality", "host": host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"],
        "model": os.path.basename(args.model), "mtp_head": eng.mtp.head.hc.path, "in_file": not eng.mtp.head.hc.sidecar,
        "device": str(eng.cache.k.device), "load_s": load_s,
        "draft_vocab": len(vocab) if vocab is not None else eng.cfg.vocab_size, "vocab_size": eng.cfg.vocab_size,
        "code_dir": args.code_dir, "code_jsonl": args.code_jsonl, "held_out_fraction": args.held_out_fraction,
        "held_out_rule": args.held_out_rule if args.held_out_fraction is not None else None, "files": used,
        "tokens_per_file": args.tokens, "stride": args.stride, "depth": args.depth, "fast_verify": args.fast,
        "definition": "teacher-forced on the file's tokens: at each measured position n the head drafts d tokens "
                      "(no min-p stop) and one verify pass over [x_n, drafts] accepts greedily; draft k is examined "
                      "when drafts 1..k-1 were accepted",
        "summary": summary, "timings_ms": timings,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"mtp_quality-{Path(args.model).name.removesuffix('.gguf')}-{datetime.date.today():%Y%m%d}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(summary, out / f"{stem}.png", f"{result['model']} + {os.path.basename(result['mtp_head'])}, "
         f"{summary['rounds']} rounds over {len(used)} files, {result['device']}")
    print(f"wrote {out / stem}.json/.png")
    print(f"{'depth':>5} {'examined':>9} {'cond.hit':>9} {'survival':>9}")
    for k in range(args.depth):
        print(f"{k + 1:>5} {summary['reached'][k]:>9} {summary['conditional_hit_rate'][k]:>9.3f} "
              f"{summary['chain_survival'][k]:>9.3f}")
    print(f"min-p {args.min_p}: {summary['drafts_per_round_at_min_p']:.2f} drafts/round, "
          f"{summary['tokens_per_round_at_min_p']:.2f} tokens/round; "
          + "  ".join(f"{k} {v['mean_ms']:.2f} ms" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The training curves of a run (train.json written by `python -m alphallama.train run`):
the model's loss and the MTP head's loss per depth, on training batches and held-out
files, against tokens seen.

    python -m alphallama.train.plot train.json -o curves.png      (needs matplotlib: the [train] extra)
"""
from __future__ import annotations

import argparse
import json


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tr, va = report["curves"]["train"], report["curves"]["val"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, rows, title in ((axes[0], tr, "training batches"), (axes[1], va, "held-out files")):
        x = [r["tokens"] / 1e6 for r in rows]
        ax.plot(x, [r["loss"] for r in rows], label="model (next token)", color="black")
        for k in range(len(rows[0]["mtp"]) if rows else 0):
            ax.plot(x, [r["mtp"][k] for r in rows], label=f"MTP depth {k + 1}", alpha=0.8)
        ax.set_xlabel("tokens seen (M)")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.set_ylim(top=min(6.0, max(r["loss"] for r in rows) + 0.5) if rows else None)
        ax.grid(alpha=0.3)
        ax.legend()
    c = report["config"]
    fig.suptitle(f"embedded qwen3moe {report['params'] / 1e6:.1f}M ({c['n_layers']} layers, {c['n_experts']} experts "
                 f"top-{c['n_experts_used']}), {report['state']['tokens'] / 1e6:.0f}M tokens in "
                 f"{report['state']['trained_s']:.0f} s on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m alphallama.train.plot")
    p.add_argument("report")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    with open(args.report) as f:
        plot(json.load(f), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

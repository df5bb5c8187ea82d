"""`python -m alphallama.train run --out DIR [...]`: build the corpus, train the tokenizer,
the model and its MTP head, and export the GGUF pair. See README.md, "Training the
embedded model"."""
from __future__ import annotations

import argparse
import sys

from ..config import DEFAULTS


def main(argv: list[str] | None = None) -> int:
    from . import pipeline
    p = argparse.ArgumentParser(prog="python -m alphallama.train",
                                description="train the embedded qwen3moe model and its MTP head")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="corpus -> tokenizer -> training -> GGUF + MTP sidecar")
    pipeline.add_arguments(r, DEFAULTS.train)
    join = sub.add_parser("join", help="join NAME.part0, .part1, ... checking SHA256SUMS")
    join.add_argument("first_part")
    join.add_argument("-o", "--output", required=True)
    join.add_argument("--sums", required=True, help="the SHA256SUMS file written by `run`")
    args = p.parse_args(argv)
    try:
        if args.cmd == "join":
            return _join(args)
        return pipeline.run(args)
    except (OSError, ValueError) as e:
        print(f"alphallama.train: {e}", file=sys.stderr)
        return 2


def _join(args) -> int:
    from pathlib import Path

    from .export import join_parts
    sums = dict(reversed(line.split(None, 1)) for line in Path(args.sums).read_text().splitlines() if line)
    sums = {k.strip(): v for k, v in sums.items()}
    first = Path(args.first_part)
    name = first.name[:first.name.rindex(".part")]
    if name not in sums:
        raise ValueError(f"{args.sums} lists no sha256 for {name}")
    join_parts(first, args.output, sums[name])
    print(f"joined {args.output} (sha256 ok)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

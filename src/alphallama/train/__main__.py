"""`python -m alphallama.train run --out DIR [...]`: build the corpus, train the tokenizer,
the model and its MTP head, and export the GGUF pair. `python -m alphallama.train join
DIR/NAME.sha256 -o FILE` joins parts (parts.py), checking each and the whole. See
README.md, "Training the embedded model"."""
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
    join = sub.add_parser("join", help="join NAME.part00, .part01, ... checking each part's and the whole "
                                       "file's sha256 (the parts of `run` and of distill_mtp)")
    join.add_argument("sums", help="the NAME.sha256 file written beside the parts")
    join.add_argument("-o", "--output", required=True, help="the joined file")
    args = p.parse_args(argv)
    try:
        if args.cmd == "join":
            return _join(args)
        return pipeline.run(args)
    except (OSError, ValueError) as e:
        print(f"alphallama.train: {e}", file=sys.stderr)
        return 2


def _join(args) -> int:
    from .parts import join_parts
    digest = join_parts(args.sums, args.output)
    print(f"joined {args.output} (sha256 {digest}, every part checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

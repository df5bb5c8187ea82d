"""What a grammar costs a decode: tokens/s of the same greedy request with and without a
JSON-schema constraint, and the share of a round the masks take (engine, one model).

  PYTHONPATH=src python bench/grammar_decode_cost.py [-m MODEL.gguf] [--spec-type ngram] --out OUT.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from alphallama.engine import Engine, Generation
from alphallama.grammar import TokenConstraint, json_schema_grammar
from alphallama.spec.config import SpecConfig

EMBEDDED = Path(__file__).resolve().parents[1] / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 200},
    "args": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                         "type": {"type": "string"}},
                                        "required": ["name", "type"]}, "maxItems": 6}},
    "required": ["name", "summary", "args"]}
PROMPT = "Describe the Python function json.dumps as JSON: its name, a summary and its arguments."


def run(engine: Engine, ids: list[int], n: int, spec: SpecConfig, grammar: str | None) -> dict:
    gen = Generation()
    c = TokenConstraint(engine.grammar_vocab, grammar) if grammar is not None else None
    t0 = time.perf_counter()
    toks = list(engine.generate(ids, n, gen=gen, spec=spec, constraint=c))
    wall = time.perf_counter() - t0
    return {"tokens": len(toks), "wall_s": wall, "tok_s": len(toks) / wall, "rounds": gen.stats.rounds,
            "draft_n": gen.stats.draft_n, "draft_n_accepted": gen.stats.draft_n_accepted,
            "finish_reason": gen.finish_reason, "ids": toks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default=str(EMBEDDED))
    ap.add_argument("--spec-type", default="none")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device=args.device)
    ids = engine.encode_chat([{"role": "user", "content": PROMPT}])
    spec = SpecConfig(args.spec_type, gate=False) if args.spec_type != "none" else SpecConfig("none")
    grammar = json_schema_grammar(SCHEMA)
    _ = engine.grammar_vocab   # built once, outside the timings
    run(engine, ids, 8, spec, grammar)   # warm
    out = {"model": Path(args.model).name, "device": str(engine.cache.k.device), "spec_type": args.spec_type,
           "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "arms": {}}
    for arm, g in (("free", None), ("json_schema", grammar)) * args.repeats:
        r = run(engine, ids, args.n, spec, g)
        out["arms"].setdefault(arm, []).append(r)
        print(arm, {k: v for k, v in r.items() if k != "ids"}, flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

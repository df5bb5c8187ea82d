"""`alphallama run`: generate from a prompt, streaming text to stdout (or one JSON object)."""
from __future__ import annotations

import argparse
import json
import sys

from .config import DEFAULTS


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `run` and `serve` (llama.cpp's names where one exists)."""
    p.add_argument("-m", "--model", help="GGUF model file (default: the embedded model)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context length in tokens")
    p.add_argument("--device", default=DEFAULTS.engine.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=DEFAULTS.sampling.seed)
    p.add_argument("--temp", type=float, default=DEFAULTS.sampling.temperature)
    p.add_argument("--top-k", type=int, default=DEFAULTS.sampling.top_k)
    p.add_argument("--top-p", type=float, default=DEFAULTS.sampling.top_p)
    p.add_argument("--min-p", type=float, default=DEFAULTS.sampling.min_p)
    p.add_argument("--draft-head", default=None,
                   help="MTP head GGUF for --spec-type mtp (default: the model's own, or <model>.mtp.gguf beside it)")
    from .offload.apply import add_gpu_mem_argument
    add_gpu_mem_argument(p)   # the automatic plan's device budget (offload/)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .spec.config import add_spec_arguments
    add_model_arguments(p)
    add_spec_arguments(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-n", "--n-predict", type=int, default=DEFAULTS.sampling.max_tokens)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, gen_ids, text")


def resolve_model(path: str | None) -> str:
    """The model to load: the given path, else the one embedded in the package."""
    if path:
        return path
    from importlib.resources import files
    return str(files("alphallama") / "data" / DEFAULTS.engine.default_model)


def sampling_from_args(args):
    from .sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed)


def run(args) -> int:
    from .engine import Engine, Generation
    from .spec.config import spec_from_args
    try:
        spec = spec_from_args(args)
    except ValueError as e:
        print(f"alphallama: error: {e}", file=sys.stderr)
        return 2
    from .offload.apply import engine_kwargs, plan_from_args
    from .offload.plan import PlanError
    path = resolve_model(args.model)
    try:   # the layout for every setting left unset (ALPHA_AUTO=0: none)
        plan = plan_from_args(args, path)
    except PlanError as e:
        print(f"alphallama: error: {e}", file=sys.stderr)
        return 2
    engine = Engine.load(path, draft_head=args.draft_head, **engine_kwargs(args, plan))
    tok = engine.tokenizer
    if args.chat:
        ids = engine.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = engine.encode_prompt(args.prompt)
    gen = Generation()
    stream = tok.stream()
    try:
        for t in engine.generate(ids, args.n_predict, sampling_from_args(args), gen=gen, spec=spec):
            piece = stream.feed(t)
            if piece and not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except ValueError as e:   # context overflow, bad sampling values
        print(f"alphallama: error: {e}", file=sys.stderr)
        return 2
    tail = stream.flush()
    if args.json:
        print(json.dumps({"prompt_ids": ids, "gen_ids": gen.tokens, "text": tok.decode(gen.tokens, continuation=True),
                          "finish_reason": gen.finish_reason, "timings": gen.stats.timings(),
                          "mode": spec.mode, "wide_verify_on_tensor_cores": bool(getattr(engine.model, "hybrid", False)),
                          "spec": gen.spec.to_dict()}))
    else:
        sys.stdout.write(tail + "\n")
        s = gen.stats
        print(f"[{s.prompt_n} prompt tokens in {s.prompt_ms:.0f} ms, {s.predicted_n} generated at "
              f"{s.predicted_per_second:.1f} tok/s, {gen.spec.tokens_per_round:.2f} tokens/round, "
              f"{spec.mode} mode, finish: {gen.finish_reason}]", file=sys.stderr)
    return 0

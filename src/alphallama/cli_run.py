"""`alphallama run`: generate from a prompt, streaming text to stdout (or one JSON object)."""
from __future__ import annotations

import argparse
import json
import re
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
    add_penalty_arguments(p)
    p.add_argument("--draft-head", default=None,
                   help="MTP head GGUF for --spec-type mtp (default: the model's own, or <model>.mtp.gguf beside it)")
    from .offload.apply import add_memory_arguments
    add_memory_arguments(p)   # the automatic plan's device and host budgets (offload/)


def add_penalty_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's penalties and logit bias flags (penalties.py; on serve: the requests' defaults)."""
    d = DEFAULTS.sampling
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, metavar="X",
                   help="divide a positive logit (multiply a negative one) of every token in the last "
                        "--repeat-last-n tokens by X (1.0: off)")
    p.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n, metavar="N",
                   help="the penalties' window: the last N tokens of prompt and output (0: off, -1: the context)")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty, metavar="X",
                   help="subtract X from the logit of every token in the window (-2..2; 0: off)")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, metavar="X",
                   help="subtract X times its count in the window from a token's logit (-2..2; 0: off)")
    p.add_argument("-l", "--logit-bias", type=logit_bias_flag, action="append", default=[],
                   metavar="TOKEN_ID(+/-)BIAS", help="add BIAS to a token's logit, e.g. 15043+1, 15043-1 "
                                                     "or 15043-inf (never); repeatable")


def logit_bias_flag(text: str) -> tuple[int, float]:
    """llama.cpp's --logit-bias value: TOKEN_ID followed by a signed bias (15043+1, 15043-inf)."""
    m = re.fullmatch(r"(\d+)([+-])(.+)", text.strip())
    try:
        if m is None:
            raise ValueError
        bias = float(m.group(3))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS such as 15043+1, got {text!r}") from None
    return int(m.group(1)), -bias if m.group(2) == "-" else bias


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .spec.config import add_spec_arguments
    add_model_arguments(p)
    add_spec_arguments(p)
    p.add_argument("-p", "--prompt", help="the prompt (required; with -cnv: the system message, if any)")
    p.add_argument("-n", "--n-predict", type=int, default=DEFAULTS.sampling.max_tokens)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, gen_ids, text")
    from .cli_compat import add_compat_arguments
    add_compat_arguments(p, "run")


def resolve_model(path: str | None) -> str:
    """The model to load: the given path, else the one embedded in the package."""
    if path:
        return path
    from importlib.resources import files
    return str(files("alphallama") / "data" / DEFAULTS.engine.default_model)


def check_device(args) -> str | None:
    """Why the asked-for device cannot be used (None: it can), found before anything loads."""
    from .engine import resolve_device
    try:
        resolve_device(args.device)
    except ValueError as e:
        return str(e)
    return None


def load_engine(args, path: str, plan, progress, slots: int = 1):
    """Engine.load with the plan's settings (explicit flags win), showing its stages on
    `progress` (a LoadProgress); slots: parallel streams (serve's -np)."""
    from .engine import Engine
    from .offload.apply import engine_kwargs
    kw = engine_kwargs(args, plan)
    if getattr(args, "threads", None) and kw.get("expert_slots") is not None:   # -t: the store's CPU workers
        kw["cpu_threads"] = args.threads
    progress.weights()
    try:
        engine = Engine.load(path, draft_head=args.draft_head, progress=progress.update, slots=slots,
                             weights_read=lambda: progress.begin("building the KV cache, graphs and MTP head"), **kw)
    except BaseException:
        progress.abandon()
        raise
    progress.end()
    return engine


def warm_engine(args, engine, spec, progress) -> None:
    """The warm-up at load (warmup.py), unless --no-warmup."""
    from .cli_compat import warmup_wanted
    from .warmup import warm_up
    if warmup_wanted(args):
        progress.begin("warming up (cost table, prefill and decode kernels)")
        try:
            warm_up(engine, spec)
        except BaseException:
            progress.abandon()
            raise
        progress.end()


def sampling_from_args(args):
    from .sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, seed=args.seed, repeat_penalty=args.repeat_penalty,
                          repeat_last_n=args.repeat_last_n, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, logit_bias=tuple(args.logit_bias))


def _fail(message: str) -> int:
    print(f"alphallama: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    from .cli_compat import apply_compat
    from .engine import Generation
    from .load_progress import LoadProgress
    from .spec.config import spec_from_args
    apply_compat(args, "run")
    if args.prompt is None and not args.conversation:
        return _fail("-p/--prompt is required (or -cnv for a conversation)")
    if args.conversation and args.json:
        return _fail("--json does not apply to -cnv (a conversation streams text)")
    problem = check_device(args)
    if problem:
        return _fail(problem)
    try:
        spec = spec_from_args(args)
        sampling_from_args(args).validate()
    except ValueError as e:
        return _fail(str(e))
    from .offload.apply import plan_from_args
    from .offload.plan import PlanError
    path = resolve_model(args.model)
    try:   # the layout for every setting left unset (ALPHA_AUTO=0: none)
        plan = plan_from_args(args, path)
    except PlanError as e:
        return _fail(str(e))
    progress = LoadProgress(path)
    engine = load_engine(args, path, plan, progress)
    tok = engine.tokenizer
    if args.conversation:
        from .cli_chat import chat_loop
        warm_engine(args, engine, spec, progress)
        return chat_loop(engine, spec, sampling_from_args(args), args.n_predict, args.prompt)
    import jinja2
    from .engine import ContextOverflow
    try:   # a prompt over the context, or a template that refuses these messages: its reason, no traceback
        if args.chat:
            ids = engine.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            ids = engine.encode_prompt(args.prompt)
    except ContextOverflow as e:
        return _fail(str(e))
    except (ValueError, jinja2.TemplateError) as e:
        return _fail(f"the chat template: {e}")
    warm_engine(args, engine, spec, progress)
    gen = Generation()
    stream = tok.stream()
    try:
        for t in engine.generate(ids, args.n_predict, sampling_from_args(args), gen=gen, spec=spec):
            piece = stream.feed(t)
            if piece and not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except ValueError as e:   # context overflow, bad sampling values
        return _fail(str(e))
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

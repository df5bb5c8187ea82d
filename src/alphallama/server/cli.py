"""`alphallama serve` / `alphallama-serve`: the OpenAI-compatible server.

Flags follow llama-server's names where it has one. The HTTP server starts first and
the model loads behind it (GET /health is 503 until then), with a progress bar; a model
that fails to load stops the server with the reason.
"""
from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from ..config import DEFAULTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli_run import add_model_arguments
    from ..spec.config import add_spec_arguments
    d = DEFAULTS.server
    add_model_arguments(p)
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("ALPHALLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $ALPHALLAMA_API_KEY, else no key)")
    p.add_argument("-n", "--n-predict", type=int, default=d.n_predict,
                   help="max tokens when a request sets none (-1: until end of text or a full context)")
    p.add_argument("--chat-template-file", default=None, help="a Jinja chat template to use instead of the model's")
    p.add_argument("--alias", default=None, help="the model name clients use (default: the file's name)")
    p.add_argument("--queue-size", type=int, default=d.queue_size,
                   help="requests that may wait for the engine; more are answered 429")
    p.add_argument("--cors-origins", type=_origins, default=(), metavar="ORIGIN[,ORIGIN]",
                   help="web origins besides local pages whose browser requests are answered (*: any)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    add_spec_arguments(p)


def _origins(text: str) -> tuple[str, ...]:
    from .cors import parse_origins
    return parse_origins(text)


def _fail(message: str) -> int:
    print(f"alphallama serve: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from ..chat import CHAT_TEMPLATE_KEY, ChatTemplate, ChatTemplateError
    from ..cli_run import resolve_model, sampling_from_args
    from ..engine import Engine
    from ..spec.config import SPEC_TYPES, spec_from_args
    from .app import create_app
    from .state import ServerSettings

    path = resolve_model(args.model)   # GGUFError: cli.py prints it
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be in 0..65535, got {args.port}")
    if args.n_predict == 0 or args.n_predict < -1:
        return _fail(f"-n/--n-predict must be -1 or positive, got {args.n_predict}")
    if args.ctx_size is not None and args.ctx_size <= 0:
        return _fail(f"-c/--ctx-size must be positive, got {args.ctx_size}")
    if args.queue_size < 0:
        return _fail(f"--queue-size must be >= 0, got {args.queue_size}")
    try:
        spec = spec_from_args(args)
        sampling = sampling_from_args(args)
        sampling.validate()
        template = None
        if args.chat_template_file:
            with open(args.chat_template_file, encoding="utf-8") as f:
                template = f.read()
            ChatTemplate(template)   # a syntax error stops us now, not after loading
    except (ValueError, OSError) as e:   # ChatTemplateError is a ValueError
        return _fail(str(e))
    from ..gguf.reader import GGUFError
    from ..offload.apply import engine_kwargs, plan_from_args, summary
    try:   # the layout for every setting left unset, from the header and free memory (ALPHA_AUTO=0: none)
        plan = plan_from_args(args, path)
    except GGUFError as e:
        return _fail(f"could not load {path}: {e}")
    except ValueError as e:   # PlanError: nothing fits
        return _fail(str(e))

    def load() -> Engine:
        from tqdm import tqdm
        size = os.path.getsize(path)
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"loading {os.path.basename(path)}",
                  file=sys.stderr, disable=None) as bar:
            engine = Engine.load(path, draft_head=args.draft_head, progress=lambda _name, n: bar.update(n),
                                 **engine_kwargs(args, plan))
        if engine.mtp is None and "mtp" in SPEC_TYPES.get(spec.spec_type, ()):   # fail now, not in every request
            raise ValueError(f"--spec-type {spec.spec_type} needs a model with an MTP head and {path} has none "
                             f"(an in-file head, '<model>.mtp.gguf' beside it, or --draft-head FILE)")
        if template is not None:
            try:   # the file's BOS/EOS texts still apply to the replacement template
                engine.chat_template = ChatTemplate.from_gguf_metadata(
                    {**engine.gguf.metadata, CHAT_TEMPLATE_KEY: template})
            except ChatTemplateError as e:
                raise ValueError(f"--chat-template-file: {e}") from None
        c = engine.cfg
        print(f"alphallama: loaded {path}: {c.arch}, {c.n_layers} layers, d_model {c.d_model}, "
              f"vocab {c.vocab_size}, context {engine.ctx_size}, layout {summary(plan)}, speculation "
              f"{spec.on_device(engine.cache.k.device.type).spec_type} ({spec.mode}"
              f"{', wide rounds on the tensor cores' if getattr(engine.model, 'hybrid', False) else ''}); ready",
              file=sys.stderr, flush=True)
        return engine

    settings = ServerSettings(
        model_names=ServerSettings.names_for(path, args.alias), api_key=args.api_key or None,
        n_predict=args.n_predict, sampling=sampling, spec=spec, queue_size=args.queue_size,
        cors_origins=args.cors_origins)
    failed: list[BaseException] = []

    def on_load_failed(e: BaseException) -> None:   # runs in the worker thread
        failed.append(e)
        server.should_exit = True

    app = create_app(settings, load, on_load_failed=on_load_failed)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.verbose,
                            log_level="info" if args.verbose else "warning", timeout_graceful_shutdown=5)
    server = _Server(config, settings.alias)
    server.run()
    if failed:
        return _fail(f"could not load {path}: {failed[0]}")
    return 0


class _Server(uvicorn.Server):
    """uvicorn.Server that prints the URL it is bound to (the real port when --port 0)."""

    def __init__(self, config: uvicorn.Config, alias: str):
        super().__init__(config)
        self.alias = alias

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for s in self.servers:
            for sock in s.sockets:
                host, port = sock.getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                print(f"alphallama: serving model {self.alias!r} at http://{host}:{port}/v1 "
                      f"(OpenAI base URL); health at http://{host}:{port}/health", file=sys.stderr, flush=True)

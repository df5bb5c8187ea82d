"""`alphallama serve` / `alphallama-serve`: the OpenAI-compatible server.

Flags follow llama-server's names where it has one (its other habitual flags: cli_compat.py).
The port is bound first (one in use stops us before anything loads), then the HTTP server
starts and the model loads and warms up behind it (GET /health is 503 until then), its
stages shown (load_progress.py); a model that fails to load stops the server with the reason.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket
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
    p.add_argument("--pooling", choices=("mean", "cls", "last"), default=d.pooling,
                   help="/v1/embeddings: how an input's final hidden states are pooled into one vector")
    p.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default=d.reasoning_format,
                   help="a thinking model's <think> text: in reasoning_content (auto, deepseek) or left in content "
                        "(none); a request's reasoning_format overrides it")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    add_spec_arguments(p)
    from ..cli_compat import add_compat_arguments
    add_compat_arguments(p, "serve")


def _origins(text: str) -> tuple[str, ...]:
    from .cors import parse_origins
    return parse_origins(text)


def _fail(message: str) -> int:
    print(f"alphallama serve: error: {message}", file=sys.stderr)
    return 2


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use (or a host that is not ours) stops
    the command before the model loads and before any URL is printed. OSError if not."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:   # as uvicorn binds: a port in TIME_WAIT after a restart is free, one with a listener is not
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    import jinja2

    from ..chat import CHAT_TEMPLATE_KEY, ChatTemplate, ChatTemplateError
    from ..cli_compat import apply_compat
    from ..cli_run import check_device, load_engine, resolve_model, sampling_from_args, warm_engine
    from ..engine import Engine
    from ..load_progress import LoadProgress
    from ..spec.config import SPEC_TYPES, spec_from_args
    from .app import create_app
    from .state import ServerSettings

    apply_compat(args, "serve")
    path = resolve_model(args.model)   # GGUFError: cli.py prints it
    problem = check_device(args)
    if problem:
        return _fail(problem)
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be in 0..65535, got {args.port}")
    if args.n_predict == 0 or args.n_predict < -1:
        return _fail(f"-n/--n-predict must be -1 or positive, got {args.n_predict}")
    if args.ctx_size is not None and args.ctx_size <= 0:
        return _fail(f"-c/--ctx-size must be positive, got {args.ctx_size}")
    if args.queue_size < 0:
        return _fail(f"--queue-size must be >= 0, got {args.queue_size}")
    slots = args.parallel or 1
    try:
        spec = spec_from_args(args)
        sampling = sampling_from_args(args)
        sampling.validate()
        template = None
        if args.chat_template_file:
            with open(args.chat_template_file, encoding="utf-8") as f:
                template = f.read()
            ChatTemplate(template)   # a syntax error stops us now, not after loading
    except (ValueError, OSError, jinja2.TemplateError) as e:   # ChatTemplateError: a ValueError (and/or Jinja's)
        return _fail(str(e))
    from ..gguf.reader import GGUFError
    from ..offload.apply import plan_from_args, summary
    try:   # the layout for every setting left unset, from the header and free memory (ALPHA_AUTO=0: none)
        plan = plan_from_args(args, path)
    except GGUFError as e:
        return _fail(f"could not load {path}: {e}")
    except ValueError as e:   # PlanError: nothing fits
        return _fail(str(e))

    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        why = e.strerror or str(e)
        hint = " (another server is there? choose another --port, or --port 0 for any free one)" \
            if e.errno == errno.EADDRINUSE else ""
        return _fail(f"cannot listen on {args.host}:{args.port}: {why}{hint}")

    def load() -> Engine:
        progress = LoadProgress(path)
        engine = load_engine(args, path, plan, progress, slots)
        if engine.mtp is None and "mtp" in SPEC_TYPES.get(spec.spec_type, ()):   # fail now, not in every request
            raise ValueError(f"--spec-type {spec.spec_type} needs a model with an MTP head and {path} has none "
                             f"(an in-file head, '<model>.mtp.gguf' beside it, or --draft-head FILE)")
        if template is not None:
            try:   # the file's BOS/EOS texts still apply to the replacement template
                engine.chat_template = ChatTemplate.from_gguf_metadata(
                    {**engine.gguf.metadata, CHAT_TEMPLATE_KEY: template})
            except ChatTemplateError as e:
                raise ValueError(f"--chat-template-file: {e}") from None
        warm_engine(args, engine, spec, progress)   # before /health says 200: the first request pays nothing
        c = engine.cfg
        print(f"alphallama: loaded {path}: {c.arch}, {c.n_layers} layers, d_model {c.d_model}, "
              f"vocab {c.vocab_size}, context {engine.ctx_size}"
              f"{f' in each of {len(engine.slots)} slots' if len(engine.slots) > 1 else ''}, layout {summary(plan)}, speculation "
              f"{spec.on_device(engine.cache.k.device.type).spec_type} ({spec.mode}"
              f"{', wide rounds on the tensor cores' if getattr(engine.model, 'hybrid', False) else ''}); ready",
              file=sys.stderr, flush=True)
        return engine

    settings = ServerSettings(
        model_names=ServerSettings.names_for(path, args.alias), api_key=args.api_key or None,
        n_predict=args.n_predict, sampling=sampling, spec=spec, queue_size=args.queue_size,
        cors_origins=args.cors_origins, pooling=args.pooling, reasoning_format=args.reasoning_format)
    failed: list[BaseException] = []

    def on_load_failed(e: BaseException) -> None:   # runs in the worker thread
        failed.append(e)
        server.should_exit = True

    app = create_app(settings, load, on_load_failed=on_load_failed)
    config = uvicorn.Config(app, host=args.host, port=args.port, access_log=args.verbose,
                            log_level="info" if args.verbose else "warning", timeout_graceful_shutdown=5)
    server = _Server(config, settings.alias)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
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
                      f"(OpenAI base URL); chat page at http://{host}:{port}/; health at "
                      f"http://{host}:{port}/health", file=sys.stderr, flush=True)

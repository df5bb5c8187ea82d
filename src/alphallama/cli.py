"""`alphallama run | inspect | plan | serve | bench | synth`.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only registers them, importing each lazily so `inspect`
does not pay for the server's imports.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .gguf.reader import GGUFError

# name -> (module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("alphallama.cli_run", "generate a continuation of a prompt"),
    "inspect": ("alphallama.cli_inspect", "print a GGUF model's architecture, sizes, tokenizer and template"),
    "plan": ("alphallama.cli_plan", "print the layout serve/run would choose for a model on this device"),
    "serve": ("alphallama.server.cli", "serve an OpenAI-compatible HTTP API"),
    "bench": ("alphallama.bench.arena", "run the arena benchmark against OpenAI-compatible servers"),
    "synth": ("alphallama.gguf.writer", "write a synthetic model with random weights"),
    "bench-engine": ("alphallama.bench.engine_bench", "time decode rounds and prefill on the GPU"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # allow_abbrev=False: no `--spec` for `--spec-type`; a flag means what it spells
    parser = argparse.ArgumentParser(prog="alphallama", description="Fast single-user LLM inference for GGUF models.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, allow_abbrev=False)
        if name == wanted:   # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        rc = module.run(args) or 0
        sys.stdout.flush()    # a closed pipe shows here, not in the interpreter's exit flush
        return rc
    except GGUFError as e:   # a broken or unsupported model file: one clear line, no traceback
        print(f"alphallama: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `alphallama inspect | head -1`: the reader left; stop quietly, as cat does
        _detach_stdout()
        return 141            # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe


def _detach_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of what is still
    buffered does not raise a second BrokenPipeError (printed as a traceback at exit)."""
    import os
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def serve_main() -> int:
    return main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())

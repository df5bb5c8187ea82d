"""llama-server / llama-cli flags a user types out of habit, accepted by `run` and `serve`.

Each is registered explicitly (argparse would otherwise read `-ngl 99` as `-n gl 99`: a
single dash and a known one-letter option), maps to our real setting where one exists,
and prints one line to stderr saying what it means here, so nobody wonders whether a
flag they rely on took effect.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

_FA = ("on", "off", "auto")


def _ngl(text: str) -> int | str:
    """llama.cpp takes a count, or 'auto' / 'all'."""
    if text in ("auto", "all"):
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count, 'auto' or 'all', got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a layer count must be >= 0, got {n}")
    return n


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


@dataclass(frozen=True)
class Compat:
    flags: tuple[str, ...]
    dest: str
    kwargs: dict
    commands: tuple[str, ...]            # the subcommands that take it
    apply: Callable[[argparse.Namespace, str], str]   # (args, command) -> the note; may set real settings


def _apply_ngl(args, command: str) -> str:
    n = args.n_gpu_layers
    if n == 0 and args.device == "auto":   # llama.cpp's "nothing on the GPU": the CPU
        args.device = "cpu"
        return "-ngl 0: running on the CPU (as --device cpu)"
    return (f"-ngl {n}: ignored; the automatic plan places the layers itself (all on the GPU when they fit, "
            f"else MoE experts offloaded; `alphallama plan` shows it, --gpu-mem caps it)")


def _apply_fa(args, command: str) -> str:
    return (f"-fa {args.flash_attn}: ignored; attention always runs fused flash-style kernels here "
            f"(split-KV decode, SDPA prefill) and cannot be turned off")


def _apply_jinja(args, command: str) -> str:
    return "--jinja: always on; chat templates are rendered with Jinja (the model's or --chat-template-file)"


def _apply_threads(args, command: str) -> str:
    import torch
    torch.set_num_threads(args.threads)    # this process's CPU compute (the CPU model, host-side work)
    return (f"-t {args.threads}: torch computes on {args.threads} CPU threads, and an offloaded expert "
            f"store's CPU tier (if the plan has one) runs {args.threads} expert workers")


def _apply_parallel(args, command: str) -> str:
    n = args.parallel
    if command == "run":
        return f"-np {n}: ignored; run generates for one prompt"
    if n == 1:
        return "-np 1: one stream; requests run one at a time, in arrival order (up to --queue-size more wait)"
    return (f"-np {n}: {n} parallel streams decode together in shared rounds, each slot 1/{n} of the context "
            f"(-c) with its own drafts; more requests wait in arrival order (up to --queue-size)")


def _apply_batch(args, command: str) -> str:
    from .config import DEFAULTS
    return (f"-b {args.batch_size}: ignored; prompts are prefilled in chunks of "
            f"{DEFAULTS.engine.prefill_chunk} rows (compiled at load)")


def _apply_mlock(args, command: str) -> str:
    return ("--mlock: ignored; the weights are copied into VRAM (or dequantized into RAM on the CPU) at load, "
            "not paged in from the file")


def _apply_no_warmup(args, command: str) -> str:
    return "--no-warmup: the warm-up at load is skipped; the first request pays for the lazy preparation"


def _apply_cnv(args, command: str) -> str:
    if command == "run":    # cli_run.run starts the conversation (cli_chat.py)
        return ("-cnv: an interactive conversation through the chat template, a turn per input line "
                "(-p, if given, is the system message); Ctrl-D ends it")
    return "-cnv: ignored; serve applies the chat template on /v1/chat/completions"


def _apply_embeddings(args, command: str) -> str:
    return (f"--embeddings: always on; /v1/embeddings serves the final hidden state, {args.pooling}-pooled "
            f"and normalized (--pooling picks mean, cls or last)")


COMPAT: tuple[Compat, ...] = (
    Compat(("-ngl", "--n-gpu-layers", "--gpu-layers"), "n_gpu_layers",
           {"type": _ngl, "metavar": "N", "help": "llama.cpp's layers on the GPU: 0 runs on the CPU; "
                                                   "otherwise the automatic plan decides"},
           ("run", "serve"), _apply_ngl),
    Compat(("-fa", "--flash-attn"), "flash_attn",
           {"nargs": "?", "const": "on", "choices": _FA, "help": "accepted for llama.cpp; attention is always fused"},
           ("run", "serve"), _apply_fa),
    Compat(("--jinja",), "jinja", {"action": "store_true", "default": None,
                                   "help": "accepted for llama.cpp; templates are always Jinja"},
           ("run", "serve"), _apply_jinja),
    Compat(("-t", "--threads"), "threads", {"type": _positive, "metavar": "N",
                                            "help": "CPU threads (torch's, and an expert store's CPU workers)"},
           ("run", "serve"), _apply_threads),
    Compat(("-np", "--parallel"), "parallel", {"type": _positive, "metavar": "N",
                                               "help": "serve: parallel streams (slots), each 1/N of the "
                                                       "context, its own KV rows and drafts (the copy's, "
                                                       "the MTP head's); run: ignored"},
           ("run", "serve"), _apply_parallel),
    Compat(("-b", "--batch-size"), "batch_size", {"type": _positive, "metavar": "N",
                                                  "help": "accepted for llama.cpp; the prefill chunk is fixed"},
           ("run", "serve"), _apply_batch),
    Compat(("--mlock",), "mlock", {"action": "store_true", "default": None, "help": "accepted for llama.cpp"},
           ("run", "serve"), _apply_mlock),
    Compat(("--no-warmup",), "no_warmup", {"action": "store_true", "default": None,
                                           "help": "skip the warm-up at load (the first request then pays for it)"},
           ("run", "serve"), _apply_no_warmup),
    Compat(("-cnv", "--conversation"), "conversation",
           {"action": "store_true", "default": None, "help": "run: an interactive chat (-p: the system message); serve: accepted"},
           ("run", "serve"), _apply_cnv),
    Compat(("--embedding", "--embeddings"), "embeddings",
           {"action": "store_true", "default": None, "help": "accepted for llama.cpp; /v1/embeddings is always on"},
           ("serve",), _apply_embeddings),
)


def add_compat_arguments(p: argparse.ArgumentParser, command: str) -> None:
    g = p.add_argument_group("llama.cpp flags (accepted; each prints what it means here)")
    for c in COMPAT:
        if command in c.commands:
            g.add_argument(*c.flags, dest=c.dest, **{"default": None, **c.kwargs})


def apply_compat(args: argparse.Namespace, command: str, out=None) -> None:
    """Map each llama.cpp flag given onto our settings and print its one-line note."""
    out = sys.stderr if out is None else out
    for c in COMPAT:
        if command in c.commands and getattr(args, c.dest, None) is not None:
            print(f"alphallama: {c.apply(args, command)}", file=out)


def warmup_wanted(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_warmup", None)

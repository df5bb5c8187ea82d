"""The model an engine runs: the device asked for, and the runtime that computes the
architecture there (GPUModel, the hybrids' GPUHybridModel, or the float32 reference on the CPU),
with the refusals of what a runtime cannot do yet."""
from __future__ import annotations

from typing import Callable

import torch

from .gguf.arch import ModelConfig
from .gguf.arch_qwen35 import HybridConfig
from .gguf.reader import GGUFError, GGUFFile
from .model.loader import load_model


def resolve_device(device: str) -> str:
    """auto -> cuda when a GPU is present, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available")
    return device


def build_model(f: GGUFFile, cfg: ModelConfig, ctx: int, device: str, progress: Callable[[str, int], None] | None,
                expert_slots: int | None, cpu_threads: int | None, fast: bool, host_bytes: int | None,
                miss_rates=None):
    """The runtime of f on `device` with rows for ctx positions (Engine.load's arguments)."""
    path = f.path
    if resolve_device(device) == "cuda":
        from .gguf.arch_variants import gpu_departures
        if isinstance(cfg, HybridConfig):   # Gated DeltaNet hybrids: their own facade (runtime/gpu_hybrid.py)
            from .runtime.gpu_hybrid import GPUHybridModel
            model = GPUHybridModel(f, ctx, "cuda", progress=progress, expert_slots=expert_slots,
                                   cpu_threads=cpu_threads, host_bytes=host_bytes, miss_rates=miss_rates)
        else:
            from .runtime.gpu_model import GPUModel
            missing = gpu_departures(cfg)
            if missing:   # never run a model the GPU path would compute wrongly
                raise GGUFError(f"{path}: the GPU runtime does not implement {', '.join(missing)} "
                                f"({cfg.arch}); run it with --device cpu")
            model = GPUModel(f, ctx, "cuda", progress=progress, expert_slots=expert_slots,
                             cpu_threads=cpu_threads, fast=fast and expert_slots is None,
                             host_bytes=host_bytes, miss_rates=miss_rates)
    else:
        model = load_model(f, ctx, progress)
    return model

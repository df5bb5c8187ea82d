"""Turning a GGUF file into a reference model: check the tensors, dequantize to float32."""
from __future__ import annotations

import torch

from ..gguf.arch import ModelConfig, expected_tensors, load_config
from ..gguf.arch_qwen35 import HybridConfig
from ..gguf.quants import dequantize
from ..gguf.reader import GGUFError, GGUFFile
from .qwen35 import HybridTransformer
from .transformer import Transformer


def load_weights(f: GGUFFile, cfg: ModelConfig, progress=None) -> dict[str, torch.Tensor]:
    names = list(expected_tensors(cfg))
    out = {}
    for name in names:
        t = f.tensors[name]
        try:
            out[name] = dequantize(t.data, t.qtype, t.shape)
        except ValueError as e:   # a valid file in a type we cannot compute with: name the tensor
            raise GGUFError(f"{f.path}: tensor {name!r}: {e}") from None
        if progress is not None:
            progress(name, t.nbytes)
    return out


def load_model(f: GGUFFile, max_len: int, progress=None) -> Transformer | HybridTransformer:
    cfg = load_config(f)
    model = HybridTransformer if isinstance(cfg, HybridConfig) else Transformer
    return model(cfg, load_weights(f, cfg, progress), max_len)

"""Turning a GGUF file into a reference model: check the tensors, dequantize to float32."""
from __future__ import annotations

import numpy as np
import torch

from ..gguf.arch import ModelConfig, expected_tensors, load_config
from ..gguf.arch_qwen35 import HybridConfig
from ..gguf.quants import QUANTS, dequantize
from ..gguf.reader import GGUFError, GGUFFile
from .qwen35 import HybridTransformer
from .transformer import Transformer


def dequantize_any(t) -> torch.Tensor:
    """A file tensor in float32: our torch dequantizer where we have the type, else the
    gguf package's numpy reference (the reference model may load any type it knows)."""
    if t.qtype in QUANTS:
        return dequantize(t.data, t.qtype, t.shape)
    try:
        from gguf.quants import dequantize as np_dequantize
        values = np_dequantize(np.asarray(t.data).view(np.uint8).reshape(-1), t.qtype)
    except (NotImplementedError, ValueError) as e:
        raise ValueError(f"quant type {t.qtype.name} cannot be dequantized: {e}") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.shape)


def load_weights(f: GGUFFile, cfg: ModelConfig, progress=None) -> dict[str, torch.Tensor]:
    names = list(expected_tensors(cfg))
    out = {}
    for name in names:
        t = f.tensors[name]
        try:
            out[name] = dequantize_any(t)
        except ValueError as e:   # a valid file in a type we cannot compute with: name the tensor
            raise GGUFError(f"{f.path}: tensor {name!r}: {e}") from None
        if progress is not None:
            progress(name, t.nbytes)
    return out


def load_model(f: GGUFFile, max_len: int, progress=None) -> Transformer | HybridTransformer:
    cfg = load_config(f)
    model = HybridTransformer if isinstance(cfg, HybridConfig) else Transformer
    return model(cfg, load_weights(f, cfg, progress), max_len)

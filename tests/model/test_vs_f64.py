"""The reference transformer against the independent float64 implementation
(tests/reference_f64.py) on synthetic models of every architecture and several quant
types: logits to 1e-4 relative, for a prefill and for decode steps through the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from reference_f64 import ReferenceModel

CASES = [("tiny-qwen3", "Q4_K"), ("tiny-qwen3", "Q8_0"), ("tiny-qwen3moe", "Q6_K"), ("tiny-qwen3moe", "Q4_K_M"),
         ("tiny-qwen2", "Q5_0"), ("tiny-llama", "F16")]


@pytest.mark.parametrize("preset,quant", CASES, ids=[f"{p}-{q}" for p, q in CASES])
def test_logits_match_float64(tmp_path, preset, quant):
    path = tmp_path / "m.gguf"
    write_synthetic(PRESETS[preset](n_layers=2, quant=quant, seed=11), path)
    f = GGUFFile(path)
    model = load_model(f, 64)
    toks = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    ref = ReferenceModel(f).logits(toks.tolist())                          # [T, V] float64
    cache = model.new_cache(64)
    pre, _ = model.forward(toks[:8], 0, cache)                              # prefill 8 rows
    steps = [model.forward(toks[i:i + 1], i, cache)[0] for i in range(8, 12)]   # 4 decode steps
    ours = torch.cat([pre, *steps]).double().numpy()
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-4 * scale, np.abs(ours - ref).max() / scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()

"""The architectures of gguf/arch_variants against llama.cpp, on tiny synthetic files.

tests/data/reference/archs/<preset>.json holds what llama.cpp's CPU build computed for
the preset's file (bench/llamacpp_archs.py: all F32 weights, an F32 KV cache, no flash
attention): at every position of an 8-token prompt and its 64 greedy tokens, the top-8
and 8 fixed ids' logits, the row's max |logit| and logsumexp. Ours must equal them
within 1e-4 relative (to the row's max |logit|) at every position, and our own greedy
run must produce the same 64 tokens.

Every architecture but gemma3 agrees to ~2e-6. gemma3's difference is llama.cpp's GELU:
its CPU build rounds the argument and the result to fp16 (a lookup table, ~5e-4 relative
per value), which moves the logits by up to 5.7e-4 (mean 2.5e-4). Modelling that table
(layers.gelu_fp16_table, set through the config) cuts the difference to 1.8e-4 (mean
6e-5), and that remainder is the table's own noise floor: the same model with its GELU
inputs perturbed by 1e-6 relative (float32 reassociation) moves by up to 2.7e-4. So
1e-4 cannot be met for GeGLU against this build; the bounds below are the measured
values with a margin, and the greedy tokens are identical."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.model.transformer import Transformer
from conftest import REFERENCE

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = sorted(p.stem for p in (REFERENCE / "archs").glob("*.json"))
REL = 1e-4


def _model(tmp_path, ref):
    path = tmp_path / f"{ref['preset']}.gguf"
    write_synthetic(PRESETS[ref["preset"]](seed=ref["seed"]), path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], "the writer's bytes changed"
    return load_model(GGUFFile(path), ref["n_ctx"])


def relative_errors(logits: np.ndarray, ref: dict) -> np.ndarray:
    """Per position: max |ours - llama.cpp| over the stored ids and the logsumexp,
    divided by llama.cpp's max |logit| of the row."""
    out = []
    for row, r in zip(logits, ref["rows"]):
        ids = [i for i, _ in r["top"]] + ref["fixed_ids"]
        theirs = np.array([v for _, v in r["top"]] + r["fixed"])
        m = row.max()
        lse = m + np.log(np.exp(row - m).sum())
        err = max(np.abs(row[ids] - theirs).max(), abs(lse - r["logsumexp"]), abs(np.abs(row).max() - r["absmax"]))
        out.append(err / r["absmax"])
    return np.array(out)


def _errors(model, ref) -> np.ndarray:
    ids = torch.tensor(ref["prompt_ids"] + ref["gen_ids"])
    logits, _ = model.forward(ids, 0, model.new_cache())                       # [72, V]
    return relative_errors(logits.double().numpy(), ref)


@pytest.mark.parametrize("name", CASES)
def test_logits_equal_llamacpp(tmp_path, name):
    ref = json.loads((REFERENCE / "archs" / f"{name}.json").read_text())
    model = _model(tmp_path, ref)
    rel = _errors(model, ref)
    if model.cfg.variant.ffn_act != "gelu":
        assert rel.max() < REL, (name, int(rel.argmax()), float(rel.max()))
        return
    assert rel.max() < 10 * REL, (name, float(rel.max()))       # measured 5.7e-4
    cfg = model.cfg
    as_llamacpp = replace(cfg, variant=replace(cfg.variant, ffn_act="gelu_fp16_table"))
    rel16 = _errors(Transformer(as_llamacpp, model.w, model.max_len), ref)
    assert rel16.max() < 3 * REL and rel16.mean() < rel.mean() / 3, (float(rel16.max()), float(rel.mean()))


@pytest.mark.parametrize("name", CASES)
def test_greedy_equals_llamacpp(tmp_path, name):
    ref = json.loads((REFERENCE / "archs" / f"{name}.json").read_text())
    model = _model(tmp_path, ref)
    cache = model.new_cache()
    logits, _ = model.forward(torch.tensor(ref["prompt_ids"]), 0, cache)
    out = [int(logits[-1].argmax())]
    while len(out) < len(ref["gen_ids"]):
        logits, _ = model.forward(torch.tensor(out[-1:]), cache.length, cache)
        out.append(int(logits[-1].argmax()))
    assert out == ref["gen_ids"]

"""The tiny hybrids (qwen3next, qwen35, qwen35moe) against llama.cpp's logits, stored by
bench/hybrid_llamacpp_reference.py in tests/data/reference/hybrid-tiny.json: at every
prompt row and every row of a 64-token greedy generation, our logits agree within 1e-4
of the row's largest |logit| (llama.cpp's top-5 and 4 random projections of the row),
and the greedy tokens are llama.cpp's."""
from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from conftest import REFERENCE, ROOT

sys.path.insert(0, str(ROOT / "bench"))
from hybrid_llamacpp_reference import SEED, projections  # noqa: E402

REF = json.loads((REFERENCE / "hybrid-tiny.json").read_text())
REL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(REF["models"]))
def test_logits_and_greedy_equal_llamacpp(name, tmp_path):
    ref = REF["models"][name]
    path = tmp_path / f"{name}.gguf"
    write_synthetic(PRESETS[name](seed=SEED), path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref["sha256"], "the preset no longer writes the file llama.cpp saw"
    model = load_model(GGUFFile(str(path)), 256)
    cache = model.new_cache()
    prompt, gen = ref["prompt_ids"], ref["gen_ids"]
    rows = [model.forward(torch.tensor(prompt), 0, cache)[0]]       # the prompt in one pass
    for k, t in enumerate(gen[:-1]):                                # then one row at a time, greedy
        logits = model.forward(torch.tensor([t]), len(prompt) + k, cache)[0]
        rows.append(logits)
    ours = torch.cat(rows).double().numpy()                         # [n_prompt + n_gen - 1, V]
    assert len(ours) == len(ref["top"]) == len(prompt) + len(gen) - 1
    assert ours[len(prompt) - 1:].argmax(1).tolist() == gen
    proj = ours @ projections(ours.shape[1]).T                      # [rows, 4]
    worst = 0.0
    for i, (top, p, scale) in enumerate(zip(ref["top"], ref["proj"], ref["max_abs"])):
        ids = [t for t, _ in top]
        err = max(np.abs(ours[i, ids] - [v for _, v in top]).max(), np.abs(proj[i] - p).max()) / scale
        worst = max(worst, err)
        assert err <= REL, (name, i, err)
    print(name, "worst relative difference", worst)

"""Our dequantizers against llama.cpp's own (dequantize_row_* of its CPU build), on the
blocks stored by bench/llamacpp_dequant_ref.py: the second reference beside gguf.quants."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.quants import QUANTS, dequantize

REF = json.loads((Path(__file__).parent.parent / "data" / "reference" / "dequant-llamacpp.json").read_text())


def test_every_block_type_has_a_reference():
    assert set(REF["types"]) == {t.name for t in QUANTS if t not in (T.F32, T.F16, T.BF16)}


@pytest.mark.parametrize("name", sorted(REF["types"]))
def test_equals_llamacpp(name):
    qtype, r = T[name], REF["types"][name]
    q = QUANTS[qtype]
    raw = np.frombuffer(bytes.fromhex(r["blocks"]), dtype=np.uint8)
    out = dequantize(raw, qtype, (raw.size // q.type_size * q.block_size,))
    assert out[:4].tolist() == r["first"]
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest() == r["sha256"]
    assert torch.isfinite(out).all()

"""The Gated DeltaNet step over several streams' rows in one launch (kernels/deltanet/step.py
deltanet_slots: parallel streams, one segment per stream, each on its slot's ring, state and
gates): every segment's outputs, ring rows and state are bit for bit those of the same rows
run alone through deltanet_step on that slot (a step segment writes its state, a verify
segment leaves it), whatever the segment's place in the round; a segment of no rows and a
round's padding rows touch nothing."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from alphallama.kernels.deltanet.common import RING_ROWS, W_MAX, DeltaNetShape  # noqa: E402
from alphallama.kernels.deltanet.step import (SEG_POS, SEG_ROW, SEG_ROWS, SEG_SLOT, SEG_WRITE,  # noqa: E402
                                              DeltaNetWeights, deltanet_slots, deltanet_step)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BV = 16
# (slot, position, rows, write): a verify round, a step of one row, a prompt's rows as a step, one
# from position 0, an idle segment; in this order in the round, then two padding rows
SEGMENTS = [(2, 5, 3, False), (0, 0, 1, True), (1, 9, 4, True), (3, 70, 2, False), (0, 0, 0, False)]
PAD = 2


@pytest.mark.parametrize("shape", [DeltaNetShape(hk=2, hv=4, dk=16, dv=32, tiled=False),
                                   DeltaNetShape(hk=2, hv=4, dk=32, dv=16, tiled=True)])
def test_each_stream_gets_its_rows_alone(shape):
    g = torch.Generator().manual_seed(7)
    n_slots, C, hv = 4, shape.channels, shape.hv
    W = sum(s[2] for s in SEGMENTS) + PAD
    mix = torch.randn(W, C, generator=g).to(DEV)                                    # [W, C]
    w = DeltaNetWeights((torch.randn(C, shape.d_conv, generator=g) * 0.5).to(DEV),
                        torch.randn(hv, generator=g).to(DEV), (-0.1 - 2 * torch.rand(hv, generator=g)).to(DEV))
    rings = torch.randn(n_slots, RING_ROWS, C, generator=g).to(DEV)                 # [N, R, C]
    states = (0.3 * torch.randn(n_slots, hv, shape.dk, shape.dv, generator=g)).to(DEV)
    ab = torch.randn(n_slots + 1, W_MAX, 2 * hv, generator=g).to(DEV)               # [N + 1, 64, beta | alpha]
    segs = torch.zeros(5, len(SEGMENTS), dtype=torch.int32)
    row = 0
    for i, (slot, pos, n, write) in enumerate(SEGMENTS):
        segs[[SEG_SLOT, SEG_POS, SEG_ROW, SEG_ROWS, SEG_WRITE], i] = torch.tensor([slot, pos, row, n, int(write)],
                                                                                 dtype=torch.int32)
        row += n
    rings0, states0 = rings.clone(), states.clone()
    out = deltanet_slots(mix, ab, w, rings, states, segs.to(DEV), shape, block_v=BV)
    row = 0
    for slot, pos, n, write in SEGMENTS[:-1]:
        ring, state = rings0[slot].clone(), states0[slot].clone()
        a = ab[slot, :n]
        alone = deltanet_step(mix[row:row + n].contiguous(), a[:, hv:], a[:, :hv], w, ring, state,
                              torch.tensor([pos], dtype=torch.int32, device=DEV), shape, write_state=write,
                              block_v=BV)
        assert torch.equal(out[row:row + n], alone), (slot, pos)
        assert torch.equal(rings[slot], ring) and torch.equal(states[slot], state), (slot, pos)
        assert torch.equal(states[slot], states0[slot]) != write
        row += n
    assert not out[row:].any()                                                       # padding rows: zeros

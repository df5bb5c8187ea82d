"""The IQ and MXFP4 tables: those generated from their rule equal gguf.quants' copies;
the published codebooks (read from gguf) have the properties their formats state."""
import itertools

import numpy as np
import pytest
import torch
from gguf import quants as ggq

from alphallama.gguf import iq_tables as tab
from alphallama.gguf.quants_misc import e2m1_doubled, e8m0_half


def test_ksigns_from_parity_rule():
    ours = tab.ksigns()
    assert torch.equal(ours, torch.from_numpy(np.frombuffer(ggq.IQ2_XXS.ksigns, dtype=np.uint8).copy()))
    bits = (ours.long().unsqueeze(-1) >> torch.arange(8)) & 1  # [128, 8]
    assert (bits.sum(-1) % 2 == 0).all()          # an even number of minus signs
    assert torch.equal(ours & 0x7F, torch.arange(128, dtype=torch.uint8))


def test_signs_of_matches_bits():
    idx = torch.tensor([0, 1, 127])
    s = tab.signs_of(idx)
    assert s.shape == (3, 8) and s.dtype == torch.float32
    assert torch.equal(s[0], torch.ones(8))
    assert torch.equal(s[1], torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, -1]))   # 0x81
    assert torch.equal(s[2], -torch.ones(8))                               # 0xFF: 7 bits, odd


def test_e2m1_from_its_definition():
    assert e2m1_doubled().tolist() == list(ggq.MXFP4.kvalues)


def test_e8m0_half_every_byte():
    e = np.arange(256, dtype=np.uint8).reshape(-1, 1)
    ref = ggq.MXFP4.e8m0_to_fp32_half(e).reshape(-1)
    ours = e8m0_half(torch.from_numpy(e.reshape(-1)))
    assert torch.equal(ours.view(torch.int32), torch.from_numpy(ref.copy()).view(torch.int32))
    for x in (0, 1, 2, 127, 128, 254, 255):   # 2^(e - 128) everywhere, subnormals included
        assert float(ours[x]) == 2.0 ** (x - 128)


CODEBOOKS = {"IQ2_XXS": (tab.GRID_IQ2_XXS, ggq.IQ2_XXS), "IQ2_XS": (tab.GRID_IQ2_XS, ggq.IQ2_XS),
             "IQ2_S": (tab.GRID_IQ2_S, ggq.IQ2_S), "IQ3_XXS": (tab.GRID_IQ3_XXS, ggq.IQ3_XXS),
             "IQ3_S": (tab.GRID_IQ3_S, ggq.IQ3_S), "IQ1_S": (tab.GRID_IQ1_S, ggq.IQ1_S)}


@pytest.mark.parametrize("name", list(CODEBOOKS))
def test_codebook_distinct_points_in_packed_index_order(name):
    grid, cls = CODEBOOKS[name]
    assert tuple(grid.shape) == cls.grid_shape and grid.dtype == torch.float32
    levels = {v: i for i, v in enumerate(cls.grid_map)}
    codes = torch.tensor([[levels[int(v)] for v in row] for row in grid.tolist()])  # [points, dim]
    bits = int(np.ceil(np.log2(len(cls.grid_map))))
    packed = (codes << (bits * torch.arange(grid.shape[1]))).sum(-1)  # the index ggml's tables list
    assert (packed[1:] > packed[:-1]).all()


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S"])
def test_iq2_points_lie_on_e8(name):
    """Magnitudes 1, 3, 5 (all odd) with an even count of 3s: with the even-parity signs,
    every signed point's coordinate sum is 0 mod 4, which makes it an E8 point."""
    grid, _ = CODEBOOKS[name]
    mag = {8.0: 1, 25.0: 3, 43.0: 5}
    m = torch.tensor([[mag[v] for v in row] for row in grid.tolist()])  # [points, 8]
    assert ((m == 3).sum(-1) % 2 == 0).all()
    for signs in itertools.islice(itertools.product((1, -1), repeat=8), 0, 256, 17):
        if np.prod(signs) == 1:
            assert ((m * torch.tensor(signs)).sum(-1) % 4 == 0).all()


def test_iq2_codebook_is_no_norm_rule():
    """Why the codebooks are loaded and not generated: IQ2_XXS keeps 4 of the 70 E8
    points of squared norm 40 yet 26 of norm 96, so no cut by norm produces it."""
    m = tab.GRID_IQ2_XXS.clone()
    for v, k in ((8.0, 1), (25.0, 3), (43.0, 5)):
        m[tab.GRID_IQ2_XXS == v] = k
    norms = (m ** 2).sum(-1).long()
    assert int((norms == 40).sum()) == 4 and int((norms == 96).sum()) == 26


def test_iq4_levels_and_delta():
    assert tab.IQ4_LEVELS.tolist() == list(ggq.IQ4_NL.kvalues)
    assert tab.IQ1_DELTA == 0.125

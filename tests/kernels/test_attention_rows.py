"""The row table (kernels/attention/rows.py): the rows of several streams in one round,
each with its own position and KV base, through qkv_rope and the split attention. A
stream's rows get the bits they get alone in the single-stream form (pos [1] on a cache of
their own), whatever stands beside them: rows of other streams at other positions, at the
same positions, before or after them, and a bucket's padding rows (parallel streams'
exact mode, decisions/parallel-streams.md)."""
from __future__ import annotations

import pytest
import torch

from alphallama.kernels.attention import decode as A
from alphallama.kernels.attention.decode import decode_attention, decode_attention_q8
from alphallama.kernels.attention.rope import qkv_rope
from alphallama.kernels.attention.rows import fill_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, N_KV, HD, S = 4, 2, 32, 48          # heads, kv heads, head dim, a slot's rows
TILES = A.Tiles(block_n=16, max_splits=4)


def _tables(n: int, g: torch.Generator):
    cos = torch.randn(S + 8, HD // 2, generator=g)
    sin = torch.randn(S + 8, HD // 2, generator=g)
    return cos.to(DEV), sin.to(DEV)


def _alone(qkv, pos, hist, cos, sin, early):
    """One stream's rows on its own cache (history rows 0..pos-1) in the single-stream form."""
    kc, vc = (h.clone().to(DEV) for h in hist)                                   # [n_kv, S, hd]
    p = torch.tensor([pos], dtype=torch.int32, device=DEV)
    q = qkv_rope(qkv.to(DEV), None, None, None, cos, sin, kc, vc, p, H, N_KV, HD, 1e-6, True)   # [w, H, hd]
    out = decode_attention(q, kc, vc, p, S, early=early, tiles=TILES)
    return q.cpu(), out.cpu(), kc.cpu(), vc.cpu()


def test_the_product_rounds_take_the_kernels_tiles():
    from alphallama.runtime.overrides import PRODUCT
    assert PRODUCT.attention_tiles == tuple(A.TILES)


@pytest.mark.parametrize("early", [False, True])
def test_streams_side_by_side_get_their_bits_alone(early):
    g = torch.Generator().manual_seed(7)
    cos, sin = _tables(S, g)
    # (rows, position of the first): different positions, two at the same position, a long one
    streams = [(3, 20), (1, 5), (2, 20), (4, 31)]
    hists = [(torch.randn(N_KV, S, HD, generator=g).half(), torch.randn(N_KV, S, HD, generator=g).half())
             for _ in streams]
    qkvs = [torch.randn(w, (H + 2 * N_KV) * HD, generator=g) for w, _ in streams]
    alone = [_alone(x, p, h, cos, sin, early) for x, (w, p), h in zip(qkvs, streams, hists)]
    pad = 3                                                                      # a bucket's padding rows
    R = sum(w for w, _ in streams) + pad
    kc = torch.zeros(N_KV, len(streams) * S + R, HD, dtype=torch.float16)        # slot s at base s * S
    vc = torch.zeros_like(kc)
    for s, (hk, hv) in enumerate(hists):
        kc[:, s * S:(s + 1) * S], vc[:, s * S:(s + 1) * S] = hk, hv
    kc, vc = kc.to(DEV), vc.to(DEV)
    # the streams in a rotated order: where a stream's rows sit in the round must not matter
    order = [2, 0, 3, 1]
    table = torch.zeros(3, R, dtype=torch.int32, device=DEV)
    fill_table(table, [(streams[s][0], streams[s][1], s * S) for s in order], len(streams) * S)
    qkv = torch.cat([qkvs[s] for s in order] + [torch.randn(pad, qkvs[0].shape[1], generator=g)]).to(DEV)
    q = qkv_rope(qkv, None, None, None, cos, sin, kc, vc, table, H, N_KV, HD, 1e-6, True)
    out = decode_attention(q, kc, vc, table, kc.shape[1], early=early, tiles=TILES).cpu()
    out8, _ = decode_attention_q8(q, kc, vc, table, torch.float32, (), early=early, tiles=TILES)
    q, kc, vc = q.cpu(), kc.cpu(), vc.cpu()
    r = 0
    for s in order:
        w, p = streams[s]
        aq, ao, ak, av = alone[s]
        assert torch.equal(q[r:r + w], aq), s
        assert torch.equal(out[r:r + w], ao), s
        assert torch.equal(out8.cpu()[r:r + w], ao), s
        # its K/V rows landed in its own slot, at its positions; the slot's history untouched
        assert torch.equal(kc[:, s * S:(s + 1) * S], ak) and torch.equal(vc[:, s * S:(s + 1) * S], av), s
        r += w

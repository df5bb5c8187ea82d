"""kernels/l2_warm: the side-stream kernel reads exactly the planned bytes and writes nothing
(unless told to, which is how the test sees what it read); the plan takes each weight's
first rows from every plane, within the budget. Under TRITON_INTERPRET=1 on CPU."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.kernels.l2_warm import BLOCK, L2Warm, _warm_kernel, rows_words, stream_plan  # noqa: E402
from alphallama.kernels.qweight import QuantWeight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(qtype, N, K, seed):
    """Random GGUF bytes (the plan reads plane shapes, not values)."""
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, N * K // block * size, dtype=np.uint8)
    return QuantWeight.from_raw(raw, qtype, (N, K), DEV)


def _xor(words: list[torch.Tensor]) -> int:
    acc = 0
    for w in words:
        acc ^= int(np.bitwise_xor.reduce(w.cpu().numpy().astype(np.int64) & 0xFFFFFFFF)) if w.numel() else 0
    return acc


@pytest.mark.parametrize("sizes", [(5,), (BLOCK * 3 + 7, 1, 0, 4100), (BLOCK * 2, BLOCK + 1, 3, 2, 9)])
def test_every_word_read_once(sizes):
    """With flag set, the programs' xors of what they read combine to the xor of every word
    of every segment: each word read, none twice (a word read twice would cancel), none
    outside (segments are slices of one buffer whose other words are not 0)."""
    g = torch.Generator().manual_seed(len(sizes))
    buf = torch.randint(-2**31, 2**31 - 1, (sum(sizes) + 64,), dtype=torch.int32, generator=g).to(DEV)
    segs, o = [], 0
    for n in sizes:
        segs.append(buf[o:o + n])
        o += n + 8                    # gaps of words that must not be read
    warm = L2Warm(DEV, programs=3)
    warm.flag = 1
    warm.warm(segs)                   # launches of 4 segments at most: their sinks overwrite; one group at a time
    if len(segs) <= 4:
        got = 0
        for v in warm.sink.cpu().numpy().astype(np.int64) & 0xFFFFFFFF:
            got ^= int(v)
        assert got == _xor(segs)
    else:                             # the last launch's sink: its group's xor
        last = segs[4:]
        got = 0
        for v in warm.sink.cpu().numpy().astype(np.int64) & 0xFFFFFFFF:
            got ^= int(v)
        assert got == _xor(last)


def test_nothing_written_in_the_round():
    """flag 0 (the round's): the sink stays as it was."""
    warm = L2Warm(DEV, programs=2)
    warm.sink.fill_(7)
    warm.warm([torch.arange(100, dtype=torch.int32, device=DEV)])
    assert torch.equal(warm.sink.cpu(), torch.full((2,), 7, dtype=torch.int32))


def test_kernel_reads_no_segment_of_zero_words():
    sink = torch.zeros(2, dtype=torch.int32, device=DEV)
    a = torch.tensor([5, 9], dtype=torch.int32, device=DEV)
    _warm_kernel[(2,)](a, 2, sink, 0, sink, 0, sink, 0, sink, 1, BLOCK=BLOCK, P=2, num_warps=4)
    assert (int(sink[0]) ^ int(sink[1])) == 5 ^ 9


def _bytes(segs) -> int:
    return sum(w.numel() * 4 for w in segs)


def test_rows_words_are_views_of_the_rows():
    """rows_words: views (no copy) of rows [floor(f0 N), ceil(f1 N)) of every plane."""
    a = _weight(T.Q4_K, 64, 512, 1)
    for (f0, f1), (r0, r1) in {(0.0, 0.5): (0, 32), (0.25, 0.26): (16, 17), (0.5, 1.0): (32, 64)}.items():
        segs = rows_words(a, f0, f1)
        # (planes whose rows hold less than one 16-word group are left out)
        want = [(p.data_ptr() + r0 * p.shape[-1] * p.element_size(), (r1 - r0) * p.shape[-1] * p.element_size() // 64 * 64)
                for p in a.planes.values() if (r1 - r0) * p.shape[-1] * p.element_size() >= 64]
        assert [(w.data_ptr(), w.numel() * 4) for w in segs] == want


def test_stream_plan_keeps_the_budget_ahead():
    """stream_plan: launch k reads the next budget's bytes of the stream, starting at GEMV
    k + 1 or where launch k - 1 stopped, whichever is further; never a GEMV that ran."""
    a, b, c = _weight(T.Q4_K, 64, 512, 1), _weight(T.Q6_K, 32, 256, 2), _weight(T.Q4_K, 128, 256, 3)
    # a budget of half of b: launch 0 takes b's first half, launch 1 (after b ran) c's first rows
    plan = stream_plan([[a], [b], [c]], b.nbytes // 2)
    assert len(plan) == 2
    assert [s.data_ptr() for s in plan[0]] == _starts(b, b.nbytes // 2)
    assert b.nbytes // 2 - 64 * len(b.planes) <= _bytes(plan[0]) <= b.nbytes // 2 + 64 * len(b.planes) + b.nbytes // 32
    assert [s.data_ptr() for s in plan[1]] == _starts(c, b.nbytes // 2)
    # a budget over b and c: launch 0 takes both whole, launch 1 has nothing left ahead
    plan = stream_plan([[a], [b], [c]], 10 * (b.nbytes + c.nbytes))
    assert _bytes(plan[0]) == sum(p.numel() * p.element_size() // 64 * 64 for w in (b, c) for p in w.planes.values())
    assert plan[1] == []
    # a GEMV of two weights: the window runs on from the first into the second
    plan = stream_plan([[a], [b, c]], b.nbytes + c.nbytes // 2)
    assert [s.data_ptr() for s in plan[0]] == _starts(b, b.nbytes) + _starts(c, c.nbytes // 2)
    assert stream_plan([[a], [b]], 0) == [[]]
    # never more than the budget past the next GEMV's start: with the budget b + c, the launch
    # after b reads only what lies past c within b + c of c's start, d's first b.nbytes
    d = _weight(T.Q4_K, 256, 512, 4)
    plan = stream_plan([[a], [b], [c], [d]], b.nbytes + c.nbytes)
    assert [s.data_ptr() for s in plan[0]] == _starts(b, b.nbytes) + _starts(c, c.nbytes)
    assert [s.data_ptr() for s in plan[1]] == _starts(d, b.nbytes)
    assert _bytes(plan[1]) <= b.nbytes + sum(p.shape[-1] * p.element_size() for p in d.planes.values())


def _starts(w, nbytes: int) -> list[int]:
    """The plane starts a window of w's first nbytes reads (planes under 64 bytes in it: none)."""
    f = nbytes / w.nbytes
    return [p.data_ptr() for p in w.planes.values()
            if math.ceil(p.shape[0] * f) * p.shape[-1] * p.element_size() >= 64]


def compile_warm() -> None:
    """The kernel for sm_90 (child process, no interpreter): its loads are 16-byte L2-only
    vector loads (ld.global.cg.v4), and the loop still holds them (the flag keeps them used)."""
    from tests.kernels.sm90 import compile_sm90
    from alphallama.kernels.l2_warm import PROGRAMS, _warm_kernel as K
    # as the JIT specializes the plan's segments: aligned pointers, word counts multiples of 16 (rows_words)
    ptx = compile_sm90(K, ["*i32", "i32"] * 4 + ["*i32", "i32"], dict(BLOCK=BLOCK, P=PROGRAMS),
                       divisible_ints=True).asm["ptx"]
    assert ptx.count("ld.global.cg.v4") >= 4, ptx[-3000:]                 # one or more a segment
    assert "st.global" in ptx


def test_compiles_for_sm90():
    from tests.kernels.sm90 import run_in_child
    run_in_child("test_l2_warm", "compile_warm")

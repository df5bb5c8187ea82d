"""The Gated DeltaNet kernels (kernels/deltanet) against the CPU model's recurrence run in
float64 (kernels/deltanet/reference.py on model.deltanet), and their contracts:

- step: outputs, state and conv state of W rows to float32 rounding, key heads tiled
  (qwen35) and grouped (qwen3next), from a non-zero state and from position 0;
- the row contract: a round of W rows (up to 64) gives every row the bits of W rounds of
  one row, whatever its column; a verify round's snapshots are the states those rows leave, and it
  leaves the state itself untouched;
- commit: the first n rows of a verify round, every layer in one launch, leave the bits of
  n single steps (state and conv ring);
- prefill: the chunked WY form across a chunk boundary, from a non-zero state, to float32
  rounding; and decode continuing from it."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from alphallama.kernels.deltanet.common import W_MAX, DeltaNetShape, ring_from_state, state_from_ring  # noqa: E402
from alphallama.kernels.deltanet.prefill import deltanet_prefill  # noqa: E402
from alphallama.kernels.deltanet.reference import layer_ref  # noqa: E402
from alphallama.kernels.deltanet.step import DeltaNetWeights, deltanet_commit, deltanet_step  # noqa: E402
from tests.kernels.sm90 import run_in_child  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GROUPED = DeltaNetShape(hk=2, hv=4, dk=16, dv=32, tiled=False)   # qwen3next's layout
TILED = DeltaNetShape(hk=2, hv=4, dk=32, dv=16, tiled=True)      # qwen35's
BV = 16                                                           # two column blocks per head for dv = 32


def _layer(shape: DeltaNetShape, T: int, seed: int):
    """Random inputs of T rows and a layer: (mix [T, C], alpha, beta [T, Hv] as views of one
    [T, 2Hv] buffer, weights, conv state [d-1, C], state [Hv, dk, dv])."""
    g = torch.Generator().manual_seed(seed)
    C = shape.channels
    mix = torch.randn(T, C, generator=g)
    ab = torch.randn(T, 2 * shape.hv, generator=g)                # [T, 2Hv]: [beta | alpha], as one GEMV writes them
    w = DeltaNetWeights((torch.randn(C, shape.d_conv, generator=g) * 0.5).to(DEV),
                        torch.randn(shape.hv, generator=g).to(DEV),
                        (-0.1 - 2 * torch.rand(shape.hv, generator=g)).to(DEV))
    conv = torch.randn(shape.d_conv - 1, C, generator=g)
    state = 0.3 * torch.randn(shape.hv, shape.dk, shape.dv, generator=g)
    ab = ab.to(DEV)
    return mix.to(DEV), ab[:, shape.hv:], ab[:, :shape.hv], w, conv.to(DEV), state.to(DEV)


def _pos(p: int) -> torch.Tensor:
    return torch.tensor([p], dtype=torch.int32, device=DEV)


def _close(x: torch.Tensor, ref: torch.Tensor, rel: float = 2e-6) -> None:
    """float32 result against float64: to a few ulps of the reference's largest value."""
    torch.testing.assert_close(x.double().cpu(), ref.cpu(), atol=rel * ref.abs().max().item(), rtol=0)


def _steps(mix, alpha, beta, w, ring, state, pos, shape, widths):
    """Run the rows in consecutive rounds of the given widths; -> outputs [T, Hv, dv]."""
    outs, t = [], 0
    for n in widths:
        outs.append(deltanet_step(mix[t:t + n].contiguous(), alpha[t:t + n], beta[t:t + n], w, ring, state,
                                  _pos(pos + t), shape, block_v=BV))
        t += n
    return torch.cat(outs)


@pytest.mark.parametrize("shape,pos", [(GROUPED, 7), (TILED, 1)])
def test_step_matches_the_float64_recurrence(shape, pos):
    W = 5
    mix, alpha, beta, w, conv, S0 = _layer(shape, W, seed=pos)
    if pos < shape.d_conv - 1:                                    # a fresh sequence: the rows below 0 are zeros
        conv[:shape.d_conv - 1 - pos] = 0
    ring, state = ring_from_state(conv, pos), S0.clone()
    out = deltanet_step(mix, alpha, beta, w, ring, state, _pos(pos), shape, block_v=BV)
    o, conv_ref, S_ref, _ = layer_ref(mix, alpha, beta, w, conv, S0, shape)
    _close(out, o)
    _close(state, S_ref)
    assert torch.equal(state_from_ring(ring, pos + W, shape.d_conv).double(), conv_ref)


def test_a_row_has_the_same_bits_in_any_round():
    """The row contract: one round of 5 rows, 5 rounds of one row, rounds of 2 + 3 (each row in
    another column): the same outputs, states and rings to the bit; a verify round's
    snapshots are the states the single rows leave, and the verify round writes no state."""
    shape, pos, W = TILED, 11, 5
    mix, alpha, beta, w, conv, S0 = _layer(shape, W, seed=3)
    runs, after = {}, []
    for widths in ((W,), (1,) * W, (2, 3)):
        ring, state = ring_from_state(conv, pos), S0.clone()
        if widths == (1,) * W:                                    # the state after each row, from single steps
            outs = []
            for t in range(W):
                outs.append(_steps(mix[t:t + 1], alpha[t:t + 1], beta[t:t + 1], w, ring, state, pos + t, shape, (1,)))
                after.append(state.clone())
            runs[widths] = (torch.cat(outs), state, ring)
        else:
            runs[widths] = (_steps(mix, alpha, beta, w, ring, state, pos, shape, widths), state, ring)
    base = runs[(W,)]
    for widths, run in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(run, base)), widths
    ring, state = ring_from_state(conv, pos), S0.clone()
    snaps = torch.empty(W, *S0.shape, device=DEV)
    out = deltanet_step(mix, alpha, beta, w, ring, state, _pos(pos), shape, write_state=False, snaps=snaps, block_v=BV)
    assert torch.equal(out, base[0]) and torch.equal(state, S0) and torch.equal(ring, base[2])
    assert all(torch.equal(snaps[t], after[t]) for t in range(W))


def test_a_round_of_64_rows():
    """The widest round (W_MAX = 64, the ring's bound) against rounds of 1, 1, 1 and 61 (a
    small head: the interpreter's time goes by programs x rows)."""
    shape, pos = DeltaNetShape(hk=1, hv=1, dk=16, dv=16), 70   # pos past the ring's 72 slots
    mix, alpha, beta, w, conv, S0 = _layer(shape, W_MAX, seed=64)
    runs = []
    for widths in ((W_MAX,), (1, 1, 1, W_MAX - 3)):
        ring, state = ring_from_state(conv, pos), S0.clone()
        runs.append((_steps(mix, alpha, beta, w, ring, state, pos, shape, widths), state, ring))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    o, conv_ref, S_ref, _ = layer_ref(mix, alpha, beta, w, conv, S0, shape)
    _close(runs[0][0], o)
    _close(runs[0][1], S_ref)
    assert torch.equal(state_from_ring(runs[0][2], pos + W_MAX, shape.d_conv).double(), conv_ref)


def test_commit_keeps_the_accepted_prefix():
    """A verify round over two layers, then the commit of its first n rows in one launch: the
    state n single steps leave, to the bit, and the conv ring already holds their window."""
    shape, pos, W, L = TILED, 9, 5, 2
    layers = [_layer(shape, W, seed=20 + i) for i in range(L)]
    w = DeltaNetWeights(*(torch.stack([lay[3][f] for lay in layers]) for f in range(3)))          # [L, ...]
    rings = torch.stack([ring_from_state(lay[4], pos) for lay in layers])                          # [L, R, C]
    for i, (mix, alpha, beta, wi, _, S0) in enumerate(layers):    # the round: verify writes the rows, no state
        deltanet_step(mix, alpha, beta, wi, rings[i], S0.clone(), _pos(pos), shape, write_state=False, block_v=BV)
    plain = []                                                    # per layer: (state, conv window) after each single step
    for mix, alpha, beta, wi, conv, S0 in layers:
        S, ring, after = S0.clone(), ring_from_state(conv, pos), []
        for t in range(W):
            _steps(mix[t:t + 1], alpha[t:t + 1], beta[t:t + 1], wi, ring, S, pos + t, shape, (1,))
            after.append((S.clone(), state_from_ring(ring, pos + t + 1, shape.d_conv)))
        plain.append(after)
    ab = torch.stack([torch.cat([lay[2], lay[1]], 1) for lay in layers])                          # [L, W, 2Hv]
    for n in (1, 3, W):
        state = torch.stack([lay[5] for lay in layers])                                           # [L, Hv, dk, dv]
        deltanet_commit(ab[..., shape.hv:], ab[..., :shape.hv], w, rings, state, _pos(pos), _pos(n), shape, block_v=BV)
        for i in range(L):
            assert torch.equal(state[i], plain[i][n - 1][0]), (n, i)
            assert torch.equal(state_from_ring(rings[i], pos + n, shape.d_conv), plain[i][n - 1][1]), (n, i)


@pytest.mark.parametrize("shape,T,pos", [(GROUPED, 70, 5), (TILED, 2, 3)])
def test_prefill_matches_the_recurrence_and_decode_continues(shape, T, pos):
    """T = 70 crosses a chunk of 64 (T = 2: fewer rows than the conv window), from a non-zero
    state and conv state; then 3 decode rows from what the prefill left (the prefill with its
    head whole, the step in blocks of BV: programs that split a head differently)."""
    n_dec = 3
    mix, alpha, beta, w, conv, S0 = _layer(shape, T + n_dec, seed=T)
    if shape.hv == 4:      # the regimes a chunk meets: a head decaying hard, one not at all, one writing at beta ~ 1
        alpha = alpha + torch.tensor([30.0, -30.0, 0.0, 0.0], device=DEV)
        beta = beta + torch.tensor([0.0, 0.0, 8.0, 0.0], device=DEV)
    ring, state = ring_from_state(conv, pos), S0.clone()
    out = deltanet_prefill(mix[:T].contiguous(), alpha[:T], beta[:T], w, ring, state, pos, shape, block_v=shape.dv)
    o, conv_ref, S_ref, states = layer_ref(mix, alpha, beta, w, conv, S0, shape)
    _close(out, o[:T])
    _close(state, states[T - 1])
    assert torch.equal(state_from_ring(ring, pos + T, shape.d_conv).double(),
                       layer_ref(mix[:T], alpha[:T], beta[:T], w, conv, S0, shape)[1])
    dec = deltanet_step(mix[T:].contiguous(), alpha[T:], beta[T:], w, ring, state, _pos(pos + T), shape, block_v=BV)
    _close(dec, o[T:])
    _close(state, S_ref)
    assert torch.equal(state_from_ring(ring, pos + T + n_dec, shape.d_conv).double(), conv_ref)


def test_shapes_are_checked():
    mix, alpha, beta, w, _, S0 = _layer(GROUPED, 2, seed=0)
    with pytest.raises(ValueError, match="ring"):
        deltanet_step(mix, alpha, beta, w, torch.zeros(4, GROUPED.channels, device=DEV), S0, _pos(0), GROUPED)
    with pytest.raises(ValueError, match="below position 0"):
        ring_from_state(torch.ones(GROUPED.d_conv - 1, GROUPED.channels), 1)
    with pytest.raises(ValueError, match="power of two"):
        DeltaNetShape(hk=1, hv=1, dk=24, dv=16).check()


def compile_sm90() -> None:
    """The step kernel in its four modes and the prefill's conv, at the 35B-A3B-like shape."""
    from alphallama.kernels.deltanet import prefill, step
    from tests.kernels.sm90 import compile_sm90 as compile_kernel

    shape = {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "D_CONV": 4, "TILED": True}
    types = ["*fp32"] * 10 + ["*i32", "*i32"] + ["i32"] * 8 + ["fp32", "fp32"]
    modes = ((False, True, True, False, 0), (False, True, False, True, 0), (True, False, True, False, 0),
             (False, True, True, False, 4))                         # the last: deltanet_slots's, 4 segments
    for mode in modes:
        const = dict(zip(("FROM_RING", "WRITE_OUT", "WRITE_STATE", "HAS_SNAP", "SEGS"), mode))
        compile_kernel(step._step_kernel, types, {**shape, "BV": step.BLOCK_V, **const})
    compile_kernel(prefill._conv_kernel, ["*fp32"] * 4 + ["i32"] * 3 + ["fp32"],
                   {k: shape[k] for k in ("HK", "HV", "DK", "DV", "D_CONV")} | {"BLOCK": 128, "BR": prefill.CONV_ROWS},
                   fp_fusion=True)


def test_kernels_compile_for_sm90():
    """The interpreter runs what the compiler may reject (the chunk kernel's compile takes
    ~25 s on a CPU and is left to the GPU run)."""
    run_in_child("test_deltanet_kernels")

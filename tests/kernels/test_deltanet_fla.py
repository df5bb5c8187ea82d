"""The prefill's delta rule through fla-core (kernels/deltanet/fla_rule.py) against the float64
recurrence: on CUDA with fla installed, fla's own chunk pipeline (TF32 in its solve: measured
1.6e-3 of the largest output at 512 rows on the H100); everywhere, the wrapper's part (the key-head
map of either layout, the gates, the state's orientation and its update in place) through a
float64 stand-in with fla's signature, so CI proves what we wrote without fla's kernels."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from alphallama.kernels.deltanet import fla_rule
from alphallama.kernels.deltanet.common import DeltaNetShape, ring_from_state
from alphallama.kernels.deltanet.prefill import deltanet_prefill
from alphallama.kernels.deltanet.reference import layer_ref
from alphallama.kernels.deltanet.step import DeltaNetWeights, deltanet_step
from alphallama.model.deltanet import delta_rule

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [DeltaNetShape(hk=2, hv=4, dk=64, dv=128, tiled=True),       # qwen35's key-head map
          DeltaNetShape(hk=2, hv=4, dk=128, dv=64, tiled=False)]      # qwen3next's


def _layer(shape: DeltaNetShape, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    C = shape.channels
    ab = torch.randn(T, 2 * shape.hv, generator=g).to(DEV)             # [T, 2Hv]: [beta | alpha]
    w = DeltaNetWeights((torch.randn(C, shape.d_conv, generator=g) * 0.5).to(DEV),
                        torch.randn(shape.hv, generator=g).to(DEV),
                        (-0.1 - 2 * torch.rand(shape.hv, generator=g)).to(DEV))
    return (torch.randn(T, C, generator=g).to(DEV), ab[:, shape.hv:], ab[:, :shape.hv], w,
            torch.randn(shape.d_conv - 1, C, generator=g).to(DEV),
            (0.3 * torch.randn(shape.hv, shape.dk, shape.dv, generator=g)).to(DEV))


def _stand_in(q, k, v, g, beta, scale, initial_state, output_final_state):
    """fla's chunk_gated_delta_rule contract ([B, T, HV, K] rows, log-space g, state [N, HV, K, V]),
    computed by the float64 recurrence (model.deltanet.delta_rule, whose scale is dk^-0.5)."""
    assert output_final_state and q.shape[2] == v.shape[2] and scale == q.shape[-1] ** -0.5
    o, S = delta_rule(q[0].double(), k[0].double(), v[0].double(), g[0].double(), beta[0].double(),
                      initial_state[0].double())
    return o[None].float(), S[None].float()


def _prefill_then_step(shape: DeltaNetShape, T: int, pos: int, rel: float) -> None:
    """T rows through deltanet_prefill with fla's rule from a non-zero state and conv window, then
    3 rows through our step from the state it left: within rel of the float64 layer everywhere."""
    mix, alpha, beta, w, conv, S0 = _layer(shape, T + 3, seed=T)
    ring, state = ring_from_state(conv, pos), S0.clone()
    out = deltanet_prefill(mix[:T].contiguous(), alpha[:T], beta[:T], w, ring, state, pos, shape,
                           rule=fla_rule.fla_delta_rule)
    o, _, S_ref, states = layer_ref(mix, alpha, beta, w, conv, S0, shape)

    def close(x, ref):
        torch.testing.assert_close(x.double().cpu(), ref.cpu(), atol=rel * ref.abs().max().item(), rtol=0)
    close(out, o[:T])
    close(state, states[T - 1])
    dec = deltanet_step(mix[T:].contiguous(), alpha[T:], beta[T:], w, ring, state,
                        torch.tensor([pos + T], dtype=torch.int32, device=DEV), shape)
    close(dec, o[T:])
    close(state, S_ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_wrapper_maps_heads_gates_and_state(shape, monkeypatch):
    monkeypatch.setattr(fla_rule, "_fla", lambda: SimpleNamespace(chunk_gated_delta_rule=_stand_in))
    _prefill_then_step(shape, 70, 5, 2e-6)
    # control: the other key-head map is far off (a wrong map would not pass above)
    other = DeltaNetShape(**{**shape.__dict__, "tiled": not shape.tiled})
    mix, alpha, beta, w, conv, S0 = _layer(shape, 8, seed=1)
    a = fla_rule.fla_delta_rule(mix, alpha, beta, w, S0.clone(), shape)
    b = fla_rule.fla_delta_rule(mix, alpha, beta, w, S0.clone(), other)
    assert (a - b).abs().max() > 0.1 * a.abs().max()


@pytest.mark.skipif(fla_rule.fla_unavailable(DEV) is not None,
                    reason=f"fla's chunk pipeline: {fla_rule.fla_unavailable(DEV)}")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [70, 512])
def test_fla_chunks_follow_the_recurrence(shape, T):
    _prefill_then_step(shape, T, 3, 1e-2)


def test_the_choice():
    assert fla_rule.prefill_rule("ours", DEV) == ("ours", None)
    name, rule = fla_rule.prefill_rule("fla", DEV)
    assert name == ("fla" if fla_rule.fla_unavailable(DEV) is None else "ours")
    assert (rule is None) == (name == "ours")
    assert fla_rule.fla_unavailable("cpu") == "fla's kernels run on CUDA only"


def test_a_failing_fla_falls_back_to_ours(monkeypatch, capsys):
    """fla raising at its first call (a triton it was not built for): the chunk is redone by our
    rule from the same inputs, with one warning, and ours runs from then on."""
    from alphallama.kernels.deltanet.prefill import chunk_delta_rule
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel image")
    monkeypatch.setattr(fla_rule, "_fla", lambda: SimpleNamespace(chunk_gated_delta_rule=broken))
    shape = SHAPES[0]
    mix, alpha, beta, w, conv, S0 = _layer(shape, 8, seed=2)
    rule = fla_rule._FlaOrOurs()
    xc = mix                       # any conv output: both rules read the same inputs
    s1, s2 = S0.clone(), S0.clone()
    for _ in range(2):
        got = rule(xc, alpha, beta, w, s1, shape)
        want = chunk_delta_rule(xc, alpha, beta, w, s2, shape)
        assert torch.equal(got, want) and torch.equal(s1, s2)
    assert len(calls) == 1 and "no kernel image" in rule.failed
    assert capsys.readouterr().err.count("fla's delta rule failed") == 1

"""The chunked linear cross-entropy (train/ce.py) against the plain one, the random row
subset of the MTP losses against the full mean, and the training losses of loop.py with
both switched on against the same losses switched off."""
from __future__ import annotations

from itertools import combinations

import pytest
import torch
import torch.nn.functional as F

from alphallama.train.ce import linear_ce, linear_kl, subset_rows
from alphallama.train.loop import losses
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead, mtp_losses


def _data(n=37, d=16, v=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    return h, w, torch.randint(0, v, (n,), generator=g)


def _grads(fn, h, w):
    h.grad = w.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def test_gradcheck_float64():
    h, w, t = _data(n=9, d=4, v=7)
    assert torch.autograd.gradcheck(lambda a, b: linear_ce(a, b, t, chunk=4), (h, w))


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])
def test_chunked_equals_plain(chunk):
    h, w, t = _data(dtype=torch.float32)
    ref = _grads(lambda: F.cross_entropy(h @ w.T, t), h, w)     # the independent reference
    got = _grads(lambda: linear_ce(h, w, t, chunk), h, w)
    plain = _grads(lambda: linear_ce(h, w, t, 0), h, w)
    for a, b, c in zip(got, ref, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and torch.allclose(c, b, rtol=1e-5, atol=1e-6)


def test_chunked_under_bf16_autocast_matches_plain_autocast():
    """The device's path: matrix products in bf16, softmax in float32, as F.linear under
    autocast then .float(); gradients reach the float32 leaves in float32."""
    h, w, t = _data(n=64, d=32, v=300, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(lambda: linear_ce(h, w, t, 0), h, w)
        got = _grads(lambda: linear_ce(h, w, t, 16), h, w)
    assert got[1].dtype == got[2].dtype == torch.float32
    assert abs(got[0].item() - ref[0].item()) < 1e-4
    for a, b in zip(got[1:], ref[1:]):
        assert (a - b).abs().max() <= 0.02 * b.abs().max()   # bf16 rounding of the products


def test_no_grad_and_weight_only():
    h, w, t = _data()
    with torch.no_grad():
        assert torch.allclose(linear_ce(h, w, t, 4), F.cross_entropy(h @ w.T, t))
    hd = h.detach()
    w.grad = None
    linear_ce(hd, w, t, 4).backward()
    ref = torch.autograd.grad(F.cross_entropy(hd @ w.T, t), w)[0]
    assert torch.allclose(w.grad, ref)


def test_subset_mean_is_unbiased_exactly():
    """The mean over every subset of m of n rows of the subset loss (and its gradient)
    is the full loss (and gradient): each row is in the same share of subsets."""
    h, w, t = _data(n=7, d=4, v=9)
    full = _grads(lambda: linear_ce(h, w, t, 3), h, w)
    subs = [_grads(lambda r=list(s): linear_ce(h[r], w, t[r], 3), h, w) for s in combinations(range(7), 3)]
    for i in range(3):
        assert torch.allclose(torch.stack([s[i] for s in subs]).mean(0), full[i], atol=1e-12)


def test_subset_rows():
    g = torch.Generator().manual_seed(3)
    r = subset_rows(1000, 0.25, g)
    assert r.shape == (250,) and len(set(r.tolist())) == 250 and r.min() >= 0 and r.max() < 1000
    assert (r[1:] > r[:-1]).all()
    assert subset_rows(1000, 1.0, g) is None and subset_rows(3, 0.01, g).shape == (1,)
    with pytest.raises(ValueError):
        subset_rows(10, 0.0, g)
    # every row is drawn about equally often: uniform
    counts = torch.zeros(40)
    for _ in range(2000):
        counts[subset_rows(40, 0.25, g)] += 1
    assert (counts / 2000 - 0.25).abs().max() < 0.05


CFG = MoEConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                n_experts=4, n_experts_used=2, d_ff_expert=16, ctx_len=64)


def _models():
    torch.manual_seed(0)
    model = MoEModel(CFG)
    head = MTPHead(MTPConfig.from_model(CFG.model_config(), 48))
    return model, head


def test_training_losses_chunked_equal_plain():
    model, head = _models()
    x = torch.randint(0, CFG.vocab_size, (3, 25))
    params = [p for m in (model, head) for p in m.parameters()]

    def run(chunk):
        main, mtp, aux, _, _ = losses(model, head, x, 3, "cpu", chunk=chunk)
        loss = main + 0.3 * sum(mtp) / 3 + 0.01 * aux
        return [main.item()] + [m.item() for m in mtp], torch.autograd.grad(loss, params)
    (v0, g0), (v1, g1) = run(0), run(7)
    assert v0 == pytest.approx(v1, abs=1e-5)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_mtp_subset_losses_average_to_the_full_ones():
    """mtp_losses(frac < 1) averaged over many draws approaches the full per-depth mean;
    frac = 1 is the full mean exactly; and the loss a depth scores is its rows' mean."""
    model, head = _models()
    x = torch.randint(0, CFG.vocab_size, (4, 40))
    with torch.no_grad():
        hidden, _ = model(x)
        states = head(hidden, x, model.embed, 3)
        full = torch.stack(mtp_losses(states, model.embed, x))
        assert torch.allclose(torch.stack(mtp_losses(states, model.embed, x, chunk=16, frac=1.0)), full, atol=1e-6)
        g = torch.Generator().manual_seed(0)
        draws = torch.stack([torch.stack(mtp_losses(states, model.embed, x, chunk=16, frac=0.25, generator=g))
                             for _ in range(400)])
    # per draw the estimate spreads (a quarter of ~140 rows); its mean over 400 draws is near the full
    assert (draws.std(0) > 0).all()
    assert torch.allclose(draws.mean(0), full, atol=4 * draws.std(0).max().item() / 20)


def _kl_data(n=23, d=8, v=40, seed=1):
    h, w, _ = _data(n=n, d=d, v=v, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    return h, w, torch.randn(n, d + 3, generator=g, dtype=torch.float64), torch.randn(v, d + 3, generator=g,
                                                                                   dtype=torch.float64)


@pytest.mark.parametrize("chunk", [0, 1, 6, 23, 1000])
def test_kl_matches_float64_reference(chunk):
    """The anchor's KL against torch's kl_div on full float64 logits, value and gradients."""
    h, w, ha, wa = _kl_data()
    ref = _grads(lambda: F.kl_div(F.log_softmax(h @ w.T, -1), F.log_softmax(ha @ wa.T, -1),
                                  log_target=True, reduction="batchmean"), h, w)
    got = _grads(lambda: linear_kl(h, w, ha, wa, chunk), h, w)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_kl_gradcheck_and_zero_at_the_anchor():
    h, w, ha, wa = _kl_data(n=7, d=3, v=6)
    assert torch.autograd.gradcheck(lambda a, b: linear_kl(a, b, ha, wa, chunk=3), (h, w))
    same = linear_kl(h, w, h.detach(), w.detach(), 4)
    assert abs(same.item()) < 1e-12
    same.backward()
    assert h.grad.abs().max() < 1e-12 and w.grad.abs().max() < 1e-12

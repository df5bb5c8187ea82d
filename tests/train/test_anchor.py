"""The anchor term of the training loop (loop.py, `train run --anchor W`): KL from the model
the run starts with. It is zero at the start, it is logged, and it keeps a model that
trains on other text nearer its start than the same steps without it."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from alphallama.train.loop import Hyper, frozen_copy, losses, train
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead

CFG = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                n_experts=4, n_experts_used=2, d_ff_expert=16, ctx_len=128)


def _start():
    torch.manual_seed(0)
    model = MoEModel(CFG)
    return model, MTPHead(MTPConfig.from_model(CFG.model_config(), 48))


def _kl64(a: MoEModel, b: MoEModel, x: torch.Tensor) -> float:
    """KL(a || b) a position, float64 from full logits: the independent reference."""
    with torch.no_grad():
        la = F.log_softmax(a.logits(a(x)[0]).double(), -1)
        lb = F.log_softmax(b.logits(b(x)[0]).double(), -1)
    return (la.exp() * (la - lb)).sum(-1).mean().item()


def test_losses_kl_is_the_float64_kl_from_the_anchor():
    model, head = _start()
    anchor = frozen_copy(model)
    x = torch.randint(0, CFG.vocab_size, (3, 25))
    assert abs(losses(model, head, x, 2, "cpu", anchor=anchor).kl.item()) < 1e-6    # same weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for chunk in (0, 7):
        kl = losses(model, head, x, 2, "cpu", chunk=chunk, anchor=anchor).kl.item()
        assert abs(kl - _kl64(anchor, model, x[:, :-1])) < 1e-5 and kl > 1e-3
    assert all(not p.requires_grad for p in anchor.parameters())


def test_the_anchor_keeps_the_model_near_its_start(tmp_path):
    """Both runs fit the same narrow text (one token repeated); the anchored one stays much
    nearer the start's distribution on other text, and its log shows the term."""
    text = torch.full((3000,), 5, dtype=torch.int32)
    probe = torch.randint(0, CFG.vocab_size, (4, 40))
    start, _ = _start()
    runs = {}
    for weight in (0.0, 3.0):
        model, head = _start()
        hp = Hyper(batch_size=2, ctx_len=32, lr=3e-3, warmup_steps=1, time_budget_s=600, mtp_depths=2,
                   mtp_weight=0.3, aux_weight=0.01, max_steps=25, log_every=1, val_windows=2, anchor=weight)
        st = train(model, head, text, text[:500], hp, "cpu", None, log=lambda m: None)
        runs[weight] = (_kl64(start, model, probe), st.curves["train"])
    (free, free_rows), (held, held_rows) = runs[0.0], runs[3.0]
    assert all("kl" not in r for r in free_rows) and all("kl" in r for r in held_rows)
    assert held_rows[0]["kl"] < 1e-6 < held_rows[-1]["kl"]
    assert held < 0.5 * free, (held, free)


def test_the_anchor_is_the_runs_start_when_a_checkpoint_resumes(tmp_path):
    """A second call resumes the weights from the checkpoint; the anchor is taken before
    that, from the model handed in (the start), so the first logged KL is not zero."""
    text = torch.full((3000,), 5, dtype=torch.int32)
    hp = Hyper(batch_size=2, ctx_len=32, lr=3e-3, warmup_steps=1, time_budget_s=600, mtp_depths=2,
               mtp_weight=0.3, aux_weight=0.01, max_steps=5, log_every=1, val_windows=2, anchor=1.0)
    model, head = _start()
    train(model, head, text, text[:500], hp, "cpu", tmp_path / "ck.pt", log=lambda m: None)
    model, head = _start()
    st = train(model, head, text, text[:500], replace(hp, max_steps=7), "cpu", tmp_path / "ck.pt",
               log=lambda m: None)
    assert st.step == 7 and st.curves["train"][5]["step"] == 6 and st.curves["train"][5]["kl"] > 1e-4

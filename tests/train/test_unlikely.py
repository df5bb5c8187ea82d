"""The loops' unlikelihood term (train/unlikely.py): the repeated-n-gram mask against a plain
Python reference, the loss against a float64 computation from full logits, the greedy
rollout against the inference engine's greedy decode of the shipped model, and a few
steps of the term lowering what it measures."""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from alphallama.train.loop import Hyper, train
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead
from alphallama.train.unlikely import LoopTerm, Unlikely, prefixes, repeated, rollout, unlikelihood_loss

CFG = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                n_experts=4, n_experts_used=2, d_ff_expert=16, ctx_len=128)
EMBEDDED = Path(__file__).resolve().parents[2] / "src/alphallama/data/alphallama-embedded.gguf"


def _reference_mask(row: list[int], start: int, n: int, stops: tuple[int, ...]) -> list[bool]:
    """Token by token: a position is marked when it lies in an n-gram of the continuation
    (the tokens from start on) that the continuation already wrote at least max(1, p) times,
    p the n-gram's count in the prefix, before the row's first stop."""
    mask = [False] * len(row)
    prefix = Counter(tuple(row[i:i + n]) for i in range(0, start - n + 1))
    written: Counter = Counter()
    for first in range(start, len(row) - n + 1):
        gram = tuple(row[first:first + n])
        if written[gram] >= max(1, prefix[gram]):
            for p in range(first, first + n):
                mask[p] = True
        written[gram] += 1
    first_stop = next((i for i in range(start, len(row)) if row[i] in stops), len(row))
    return [m and i < first_stop for i, m in enumerate(mask)]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_repeated_matches_reference(n):
    rng = random.Random(n)
    rows = []
    for b in range(6):
        base = [rng.randrange(12) for _ in range(rng.randrange(4, 12))]
        row = [rng.randrange(12) for _ in range(10)] + base * 8          # a planted loop
        rows.append((row + [rng.randrange(12) for _ in range(80)])[:80])
    rows[3][30] = 11                                                      # a stop in the continuation
    seq = torch.tensor(rows)
    got = repeated(seq, 16, n, stop_ids=(11,))
    want = torch.tensor([_reference_mask(r, 16, n, (11,)) for r in rows])
    assert got.shape == seq.shape
    assert torch.equal(got, want)
    assert got.any()                                                      # the planted loops are found


def test_repeated_leaves_a_fresh_continuation_and_a_copy_of_the_prefix_alone():
    seq = torch.arange(40)[None, :]                                       # no n-gram repeats
    assert not repeated(seq, 10, 4).any()
    copy = torch.cat([torch.arange(20), torch.arange(20)])[None, :]       # the prefix copied once
    assert not repeated(copy, 20, 4).any()
    log = torch.tensor([1, 2, 3, 4, 9] * 8)[None, :]                       # 3 lines of a log, copied
    assert not repeated(log, 15, 4)[0, :27].any()     # as often as the prefix holds them (27-29: a gram into line 4)
    assert repeated(log, 15, 4)[0, 30:].all()                              # and again: a loop
    twice = torch.cat([torch.arange(20), torch.arange(20), torch.arange(20)])[None, :]
    assert repeated(twice, 20, 4)[0, 40:].all()                           # the continuation repeats itself


def test_loss_matches_float64():
    torch.manual_seed(0)
    model = MoEModel(CFG).double()
    seq = torch.randint(0, CFG.vocab_size, (3, 30))
    seq[:, 20:26] = seq[:, 10:16]
    start = 12
    mask = repeated(seq, start, 3)
    assert mask.any()
    loss, share = unlikelihood_loss(model, seq, mask, "cpu", start)
    with torch.no_grad():
        hidden, _ = model(seq[:, :-1])
        p = F.softmax(model.logits(hidden), dim=-1).gather(2, seq[:, 1:, None]).squeeze(2)   # [B, L-1]
        m = mask[:, 1:]
        want = -torch.log1p(-p[m]).sum() / (seq.shape[0] * (seq.shape[1] - start))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)       # float32 log-softmax
    assert share == pytest.approx(int(m.sum()) / (3 * 18))
    loss.backward()                                                       # it trains the model
    assert model.embed.grad is not None and model.embed.grad.abs().sum() > 0


def test_prefixes_start_at_documents_half_the_time():
    tokens = torch.arange(1000) + 1000                                    # token value = position + 1000
    tokens[::97] = 0                                                      # eot every 97 tokens
    term = LoopTerm(Unlikely(weight=1.0, batch=10, prefix=8), tokens, 0, (), seed=0)
    assert term.doc_starts.tolist() == list(range(1, 1000, 97))
    pre = prefixes(tokens, term.doc_starts, 10, 8, torch.Generator().manual_seed(0))
    assert pre.shape == (10, 8)
    for row in pre:                                                       # windows of the stream
        at = int(row[0]) - 1000 if row[0] else int(row[1]) - 1001
        assert torch.equal(row, tokens[at:at + 8])
    assert all(int(r[0]) - 1000 in set(term.doc_starts.tolist()) for r in pre[:5])


def test_rollout_is_the_engines_greedy_decode():
    """The shipped model read back (init_from) and rolled out in float32 gives the tokens
    the inference engine's greedy decode gives from the GGUF file."""
    if not EMBEDDED.exists():
        pytest.skip(f"{EMBEDDED} is not in this checkout")
    from alphallama.engine import Engine
    from alphallama.train.init_from import read_start
    start = read_start(str(EMBEDDED))
    model = MoEModel(start.cfg)
    start.load_into(model, MTPHead(MTPConfig.from_model(start.cfg.model_config(), start.mtp_d_ff)))
    engine = Engine.load(str(EMBEDDED), device="cpu")
    ids = engine.encode_prompt("import os\n\n\ndef list_python_files(root):\n")
    want = list(engine.generate(ids, 24))
    got = rollout(model, torch.tensor([ids]), 24, "cpu")[0, len(ids):].tolist()
    assert got == want


def test_term_lowers_the_loops_it_measures():
    """A tiny random model loops under greedy decoding; training on the term alone makes
    its loop tokens less likely on the same rollouts."""
    torch.manual_seed(1)
    model = MoEModel(CFG)
    tokens = torch.randint(1, CFG.vocab_size, (5000,))
    tokens[::200] = 0
    term = LoopTerm(Unlikely(weight=1.0, batch=16, prefix=8, new=40, ngram=2), tokens, 0, (), seed=0)
    seq = rollout(model, prefixes(tokens, term.doc_starts, 16, 8, torch.Generator().manual_seed(0)), 40, "cpu")
    mask = repeated(seq, 8, 2)
    before, share = unlikelihood_loss(model, seq, mask, "cpu", 8)
    assert share > 0.2
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(20):
        loss, _ = unlikelihood_loss(model, seq, mask, "cpu", 8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, _ = unlikelihood_loss(model, seq, mask, "cpu", 8)
    assert after.item() < 0.5 * before.item()


def test_train_logs_the_term(tmp_path):
    torch.manual_seed(0)
    model = MoEModel(CFG)
    head = MTPHead(MTPConfig.from_model(CFG.model_config(), 48))
    tokens = torch.randint(1, CFG.vocab_size, (4000,), dtype=torch.int32)
    tokens[::300] = 0
    hp = Hyper(batch_size=2, ctx_len=32, lr=1e-3, warmup_steps=1, time_budget_s=600, mtp_depths=2,
               mtp_weight=0.3, aux_weight=0.01, max_steps=4, log_every=1, val_windows=2,
               unlikely=Unlikely(weight=0.5, every=2, batch=4, prefix=8, new=12, ngram=2))
    st = train(model, head, tokens, tokens[:500], hp, "cpu", None, log=lambda m: None, eot=0)
    rows = st.curves["train"]
    assert len(rows) == 4 and all("ul" in r and 0.0 <= r["loop_share"] <= 1.0 for r in rows)
    with pytest.raises(ValueError, match="eot"):
        train(model, head, tokens, tokens[:500], hp, "cpu", None, log=lambda m: None)


def test_cached_steps_equal_the_full_forward():
    """The rollout's (k, v) cache: hidden states of one-token steps after a prompt equal
    the full forward's at the same positions (float64)."""
    torch.manual_seed(2)
    model = MoEModel(CFG).double().eval()
    seq = torch.randint(0, CFG.vocab_size, (3, 20))
    with torch.no_grad():
        full, _ = model(seq)                                                  # [B, 20, D]
        cache: list = []
        steps = [model(seq[:, :12], cache)[0]]
        steps += [model(seq[:, t:t + 1], cache)[0] for t in range(12, 20)]
    assert len(cache) == CFG.n_layers and cache[0][0].shape[2] == 20
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-10)

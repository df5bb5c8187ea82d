"""The speculation policy at -np N through the engine (issue 33), on the CPU reference:

- each slot's stream drafts under its slot's policy memory: two streams switched off for 4
  rounds each probe MTP at their own 4th round, whatever the other does;
- a stream whose MTP chain drafted nothing (all under min-p) still claims the round, with its
  chain's ms (the allotment counts them in the round's price);
- the cost table, when it was not timed at load (`--no-warmup`), is timed on the asking
  stream's slot or a free one, never on a busy slot: a stream mid-generation beside it keeps
  its tokens, whether the asking stream's slot had room (timed in it) or not (it alone is
  forgotten); on the GPU runtime too (the interpreter: the slots of one cache, shared passes).
Every stream's tokens are its plain greedy tokens alone."""
from __future__ import annotations

import itertools

import pytest
import torch

from alphallama.engine import Engine
from alphallama.engine_slots import Verify
from alphallama.gguf.arch import find_mtp_head
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.spec.allot import Claim, Seat, allot
from alphallama.spec.config import SpecConfig
from alphallama.spec.gate import MAX_WIDTH, CostTable
from alphallama.spec.mtp import load_mtp_states
from alphallama.streams import Streams
from alphallama.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
CTX, N_NEW = 80, 8
TIMING_CTX, TIMING_NEW = 72, 3     # 72 rows a slot: a cached conversation of 9 or more leaves no room for 64
NONE: set[int] = set()             # no end-of-generation token: every stream runs its max_tokens
FLAT = CostTable([1.0 + 0.05 * w for w in range(MAX_WIDTH)], MAX_WIDTH)


def ticking():
    """A clock that advances 0.5 ms a reading: every MTP chain costs 0.5 ms."""
    ticks = itertools.count()
    return lambda: 5e-4 * next(ticks)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(model, file, tokenizer): a tiny dense model with an MTP head, the CPU reference."""
    path = tmp_path_factory.mktemp("m") / "m.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q8_0", seed=5, d_model=64, n_heads=2, n_kv_heads=1,
                                          head_dim=32, d_ff=128, vocab_size=260, mtp="dense"), path)
    f = GGUFFile(path)
    model = load_model(f, CTX)
    return model, f, Tokenizer.from_metadata(f.metadata)


@pytest.fixture(scope="module", params=["reference", "gpu"])
def any_model(request, made):
    """(model, file, tokenizer) without the head's states: the CPU reference, or the GPU runtime
    (small attention tiles and fp32 GEMVs: the interpreter's cost)."""
    if request.param == "reference":
        return made
    from alphallama.runtime.gpu_model import GPUModel
    from alphallama.runtime.overrides import Overrides
    f = made[1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = GPUModel(f, TIMING_CTX, device=dev, overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4)))
    return gpu, f, made[2]


def _engine(made, slots: int, head: bool = True, ctx: int = CTX) -> Engine:
    model, f, tok = made
    mtp = load_mtp_states(*find_mtp_head(f, model.cfg), model, ctx, tok, slots) if head else None
    return Engine(f, model, tok, None, ctx, mtp=mtp, slots=slots)


def _prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def _alone(made, prompts, head: bool = True, ctx: int = CTX, n_new: int = N_NEW) -> list[list[int]]:
    e = _engine(made, 1, head, ctx)
    out = []
    for p in prompts:
        e.reset()
        out.append(list(e.generate(p, n_new, stop_ids=NONE)))
    return out


def _collect(got: list[int]):
    return lambda t: got.append(t) or True


def test_each_slots_switch_waits_its_own_rounds(made):
    prompts = _prompts(made[0].cfg.vocab_size, [6, 4])
    e = _engine(made, 2)
    spec = SpecConfig("mtp", mtp_depth=2, mtp_min_p=0.0, gate=False, clock=ticking())
    mem = spec.memory.for_engine(e, exact=True)[1]
    mem.table = FLAT
    for s in (0, 1):
        mem.policy_for(s).switch.on, mem.policy_for(s).switch.wait = False, 4
    streams, got = Streams(e), [[], []]
    for p, g in zip(prompts, got):
        streams.add(p, N_NEW, _collect(g), spec=spec, stop_ids=NONE)
    steps = 0
    while streams.runs:
        for r in streams.step():
            assert r.error is None, r.error
        steps += 1
    assert got == _alone(made, prompts)
    for s in (0, 1):                  # off 3 rounds, a probe at the 4th, on since (too few samples to judge)
        m = mem.policy_for(s)
        assert m.decisions == {"mtp off": 3} and m.switch.on and m.switch.phase_id == 1
    assert mem.policy.mtp_cost.n >= 2 and mem.policy.mtp_cost.ms == pytest.approx(0.5)   # both streams' chains


def test_a_chain_that_drafted_nothing_claims_its_ms(made):
    """min-p 1: the head's chain runs and stops before its first draft."""
    e = _engine(made, 1)
    spec = SpecConfig("mtp", mtp_depth=2, mtp_min_p=1.0, gate=False, clock=ticking())
    spec.memory.for_engine(e, exact=True)[1].table = FLAT
    prompt = _prompts(made[0].cfg.vocab_size, [5])[0]
    core, claims, got = e.stream(prompt, N_NEW, spec=spec, stop_ids=NONE), [], []
    msg = next(core)
    try:
        while True:
            if isinstance(msg, Claim):
                claims.append(msg)
                msg = core.send(Seat(allot([msg])[0]))
            elif isinstance(msg, Verify):
                msg = core.send(e.model.verify(msg.tokens, msg.pos, msg.cache, exact=msg.exact))
            else:
                if isinstance(msg, int):
                    got.append(msg)
                msg = next(core)
    except StopIteration:
        pass
    assert got == _alone(made, [prompt])[0]
    assert claims and claims[0].conf == () and claims[0].overhead == pytest.approx(0.5)


def test_timing_the_cost_table_leaves_the_other_streams_alone(any_model, tmp_path):
    """Slot 0: stream A (10 prompt rows: no room for 64 more) mid-generation when B asks for the
    table: timed in B's own empty slot. Then C runs in slot 0 while D, whose only free slot holds
    B's finished 10 rows, asks for it again: D's slot alone is forgotten and timed in. (Each
    width timed once: the budget 0.)"""
    a, b, c, d = prompts = _prompts(any_model[0].cfg.vocab_size, [10, 8, 4, 3])
    alone = _alone(any_model, prompts, head=False, ctx=TIMING_CTX, n_new=TIMING_NEW)
    e = _engine(any_model, 2, head=False, ctx=TIMING_CTX)
    streams, got = Streams(e), {k: [] for k in "abcd"}

    def timed(name):
        return SpecConfig("ngram", 4, 1, cost_cache_dir=str(tmp_path / name), cost_budget_s=0.0)
    for busy, busy_name, ask, ask_name in ((a, "a", b, "b"), (c, "c", d, "d")):
        streams.add(busy, TIMING_NEW, _collect(got[busy_name]), spec=SpecConfig("none"), stop_ids=NONE)
        while len(got[busy_name]) < 2:                                   # mid-generation
            streams.step()
        (slot,) = [r.slot for r in streams.runs]
        rows = slot.cache.k[:, :, :len(busy)].clone()
        spec = timed(ask_name)
        run = streams.add(ask, TIMING_NEW, _collect(got[ask_name]), spec=spec, stop_ids=NONE)
        assert run.slot is not slot
        while streams.runs:
            for r in streams.step():
                assert r.error is None, r.error
        table = spec.memory.for_engine(e, exact=True)[1].table
        assert table is not None and not table.from_cache               # timed now, beside the busy stream
        assert torch.equal(slot.cache.k[:, :, :len(busy)], rows)       # its prompt's rows untouched
    assert [got[k] for k in "abcd"] == alone
    assert e.slots[1].cached[:len(d)] == d                               # D ran in B's old slot

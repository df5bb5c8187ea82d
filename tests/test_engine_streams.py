"""Parallel streams (streams.py, engine_slots.py): streams of different prompts decoded
together, started at different times, give each stream exactly the tokens it gets alone
(greedy, with and without the copy drafter), on the GPU runtime (its rows side by side
in one pass; the interpreter on the CPU) and on the CPU reference (its streams
interleaved); a stream stopped mid-way leaves the others' tokens unchanged; the slot
choice (longest common prefix, then least recently used); the round's rows allotted across
streams (spec/allot.py): drafts priced at the round's total width, a round no wider than
its room, one stream through the streams' rounds drafting as it does alone."""
from __future__ import annotations

import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.engine_slots import Slot, choose_slot
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.spec.config import SpecConfig
from alphallama.spec.gate import MAX_WIDTH, CostTable
from alphallama.streams import Streams
from alphallama.tokenizer import Tokenizer

from streamutil import drive

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX, N_NEW = 40, 4
SPECS = {"plain": SpecConfig("none"), "ngram": SpecConfig("ngram", 4, 1, gate=False)}


@pytest.fixture(scope="module", params=["gpu", "reference"])
def made(request, tmp_path_factory):
    """(a model, its file, each prompt's plain greedy tokens alone): the GPU runtime (one cache
    in slots, shared passes; small attention tiles and fp32 GEMVs: the interpreter's cost
    is per program) or the CPU reference."""
    path = tmp_path_factory.mktemp("m") / "m.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q8_0", seed=5, d_model=64, n_heads=2, n_kv_heads=1,
                                          head_dim=32, d_ff=128, vocab_size=260), path)
    f = GGUFFile(path)
    if request.param == "gpu":
        from alphallama.runtime.gpu_model import GPUModel
        from alphallama.runtime.overrides import Overrides
        model = GPUModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4)))
    else:
        model = load_model(f, CTX)
    return model, f, _alone((model, f), _prompts(model.cfg.vocab_size))


def _engine(made, slots: int) -> Engine:
    model, f = made[:2]
    return Engine(f, model, Tokenizer.from_metadata(f.metadata), None, CTX, slots=slots)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    base = [torch.randint(vocab, (n,), generator=g).tolist() for n in (3, 2, 4)]
    return [base[0] * 2, base[1] * 2 + [7], base[2]]      # repeats: the copy drafter finds matches


def _alone(made, prompts, n_new: int = N_NEW) -> list[list[int]]:
    """Plain greedy decoding of each prompt alone, from an empty cache, on one slot."""
    e = _engine(made, 1)
    out = []
    for p in prompts:
        e.reset()
        out.append(list(e.generate(p, n_new)))
    return out


@pytest.mark.parametrize("spec", list(SPECS))
def test_streams_together_get_their_tokens_alone(made, spec):
    """Each stream's tokens, with or without drafts, are its plain greedy tokens alone."""
    prompts, alone = _prompts(made[0].cfg.vocab_size), made[2]
    together, _, runs = drive(_engine(made, 3), prompts, N_NEW, SPECS[spec])
    assert together == alone
    assert all(len(t) == N_NEW for t in alone)
    assert all(r.rows for r in runs)                                   # every stream's rounds ran
    assert (max(max(r.rows) for r in runs) > 1) == (spec == "ngram")   # drafts rode in the rounds


def test_a_stopped_stream_leaves_the_others_unchanged(made):
    prompts, alone = _prompts(made[0].cfg.vocab_size), made[2]
    together, _, _ = drive(_engine(made, 3), prompts, N_NEW, SPECS["plain"], stop_after={0: 2})
    assert together[0] == alone[0][:2]
    assert together[1:] == alone[1:]


LONG_NEW = 12      # the allotment tests: long enough that the three streams share many rounds


@pytest.fixture(scope="module")
def long_runs(made):
    """(prompts that repeat, each one's plain greedy tokens alone, LONG_NEW of them)."""
    g = torch.Generator().manual_seed(11)
    base = [torch.randint(made[0].cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 2, 4)]
    prompts = [base[0] * 2, base[1] * 3, base[2] * 2]
    return prompts, _alone(made, prompts, LONG_NEW)


def test_the_rooms_shrink_when_the_round_is_full(made, long_runs):
    """Rounds of at most 3 rows, ungated drafts: three streams together verify no drafts,
    fewer streams share the room; each stream's tokens are still its own."""
    prompts, alone = long_runs
    rounds: list = []
    together, _, _ = drive(_engine(made, 3), prompts, LONG_NEW, SPECS["ngram"], max_rows=3, rounds=rounds)
    assert together == alone
    assert all(w <= 3 for n, w in rounds) and any(n == 3 for n, w in rounds)
    assert any(w > n for n, w in rounds if n == 2)             # two streams shared the room's third row


# W = 2 costs W = 1's: one draft alone is free; every row past 2 costs 100 ms more
STEP = CostTable([1.0, 1.0] + [100.0 * (w - 1) for w in range(3, MAX_WIDTH + 1)], MAX_WIDTH)


def _priced(made) -> SpecConfig:
    """The copy drafter under the priced gate, its cost table STEP (a fresh policy memory)."""
    spec = SpecConfig("ngram", 4, 1)
    spec.memory.for_engine(_engine(made, 1), True)[1].table = STEP
    return spec


def test_drafts_are_priced_at_the_rounds_total_width(made, long_runs):
    """Alone, a stream's one draft rides free (W = 2 costs W = 1's); beside another stream its
    draft would make the round 3 rows wide, at 100x: rounds of several streams verify no
    drafts (priced alone, each stream's draft would have ridden in them), and each stream's
    tokens are its own."""
    prompts, alone = long_runs
    rounds: list = []
    together, _, _ = drive(_engine(made, 3), prompts, LONG_NEW, _priced(made), rounds=rounds)
    assert together == alone
    assert all(w == n for n, w in rounds if n > 1) and any(n == 3 for n, w in rounds)
    assert any(w == 2 for n, w in rounds if n == 1)            # a stream alone in its round drafted


def test_one_stream_in_the_rounds_drafts_as_it_does_alone(made, long_runs):
    """One stream driven by Streams (its claims allotted within the round's room) and by
    Engine.generate (the gate's width): the same drafts, rounds and tokens."""
    prompt = long_runs[0][2]
    gens = [Generation(), Generation()]
    e = _engine(made, 1)
    solo = list(e.generate(prompt, LONG_NEW, gen=gens[0], spec=_priced(made)))
    e.reset()
    streams, got = Streams(e), []
    streams.add(prompt, LONG_NEW, lambda t: got.append(t) or True, gen=gens[1], spec=_priced(made))
    while streams.runs:
        streams.step()
    assert got == solo == long_runs[1][2]
    a, b = gens[0].stats, gens[1].stats
    assert (a.rounds, a.draft_n, a.draft_n_accepted) == (b.rounds, b.draft_n, b.draft_n_accepted)
    assert a.draft_n > 0                                       # drafts rode


def test_slot_choice_is_longest_prefix_then_least_recently_used():
    slots = [Slot(0, None, [1, 2, 3], used=3), Slot(1, None, [1, 2], used=1), Slot(2, None, [], used=2)]
    assert choose_slot(slots, [1, 2, 3, 4]).id == 0          # the longest common prefix
    assert choose_slot(slots, [9]).id == 1                   # none shares: the least recently used
    slots[0].busy = True
    assert choose_slot(slots, [1, 2, 3, 4]).id == 1          # a busy slot is never chosen
    for s in slots:
        s.busy = True
    with pytest.raises(ValueError, match="busy"):
        choose_slot(slots, [1])

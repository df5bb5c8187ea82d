"""Parallel streams (-np N) on the hybrids' GPU runtime (runtime/gpu_hybrid.py with a HybridSlots
cache; the interpreter on the CPU): each stream's tokens are the tokens its prompt gets alone on
a one-slot engine (exact mode per stream, decisions/parallel-streams.md).

- the runtime: three streams' rows in one pass (a step of one row, verify rounds of 3 and 4,
  in a rotated order) give each stream the logits of its rows alone bit for bit, and each
  stream's commit leaves its own state, conv window and K/V rows;
- the engine (streams.Streams): -np 3 with prompts of different lengths started at different
  steps, one stopped after 2 tokens while the others go on, a fourth taking its freed slot; then
  a continued conversation and a repeated prompt, each re-using its slot (the prompt-boundary
  checkpoint); -np 2 with the n-gram drafter in exact mode (drafts accepted in the shared rounds).

The models: tests/runtime/test_gpu_hybrid.py's tiny qwen35 (2 layers: Gated DeltaNet, then
gated attention) on fp32 activations and small attention tiles (the interpreter's cost)."""
from __future__ import annotations

import pytest
import torch

from alphallama.engine import Engine
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.kernels.deltanet.common import state_from_ring
from alphallama.runtime.gpu_hybrid import GPUHybridModel
from alphallama.runtime.hybrid_cache import HybridSlot
from alphallama.runtime.overrides import Overrides
from alphallama.spec.config import SpecConfig
from alphallama.tokenizer import Tokenizer
from tests.runtime.test_gpu_hybrid import TINY, _copying

from streamutil import drive

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX, N_NEW = 40, 3
FAST = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))
NONE: set[int] = set()          # no end-of-generation token: every stream runs its max_tokens
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for name, spec in (("plain", PRESETS["tiny-qwen35"](**TINY)), ("copying", _copying(PRESETS["tiny-qwen35"](**TINY)))):
        path = tmp_path_factory.mktemp("streams") / f"{name}.gguf"
        write_synthetic(spec, path)
        out[name] = GGUFFile(path)
    return out


def _toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(f: GGUFFile, slots: int) -> Engine:
    """An engine of `slots` slots on a model of its own (a model's slots are its latest cache's)."""
    return Engine(f, GPUHybridModel(f, CTX, device=DEV, overrides=FAST), Tokenizer.from_metadata(f.metadata), None,
                  CTX, slots=slots)


def _alone(f: GGUFFile, prompts: list[list[int]], n_new: list[int] | None = None) -> list[list[int]]:
    """Each prompt's greedy tokens (n_new[i] of them, else N_NEW) alone, on a fresh one-slot engine."""
    e = _engine(f, 1)
    out = []
    for i, p in enumerate(prompts):
        e.reset()
        out.append(list(e.generate(p, N_NEW if n_new is None else n_new[i], stop_ids=NONE)))
    return out


def test_a_pass_of_streams_gives_each_its_rows_alone(files):
    """Prompts of 5, 2 and 7 rows; then one pass of stream 2's verify round of 4 rows, stream 0's
    of 3 and stream 1's step; commits of 0, 2 and 1 rows. Each stream's logits (bit for bit),
    recurrent state, conv window and K/V rows are those of its rows run alone on a one-stream
    cache."""
    f = files["plain"]
    prompts, drafts, keep = [_toks(5, 1), _toks(2, 2), _toks(7, 3)], [_toks(3, 4), _toks(1, 5), _toks(4, 6)], [2, 1, 0]
    alone = []
    m = GPUHybridModel(f, CTX, device=DEV, overrides=FAST)
    for p, d, k in zip(prompts, drafts, keep):
        c = m.new_cache(CTX)
        m.forward(torch.tensor(p), 0, c)
        lg = m.verify(torch.tensor(d), len(p), c)[0].clone()
        c.truncate(len(p) + k)
        at = len(p) + k
        alone.append((lg, c.ssm.clone(), state_from_ring(c.ring[0], at, 4), c.k[:, :, :at].clone()))
    slots = m.new_cache(CTX, slots=3).split(3, CTX)
    assert all(isinstance(s, HybridSlot) for s in slots)
    for p, s in zip(prompts, slots):
        m.forward(torch.tensor(p), 0, s)
    order = [2, 0, 1]
    outs = m.round([(torch.tensor(drafts[i]), len(prompts[i]), slots[i]) for i in order])
    for i, (lg, _) in zip(order, outs):
        assert torch.equal(lg, alone[i][0]), i
    assert slots[1].round is None and slots[0].round == (5, 3)            # a step's state is written; a round is open
    for i, (p, s, k) in enumerate(zip(prompts, slots, keep)):
        s.truncate(len(p) + k)                                            # each stream's commit
        at = len(p) + k
        ssm, window, kv = alone[i][1:]
        assert torch.equal(s.ssm, ssm) and torch.equal(state_from_ring(s.ring[0], at, 4), window), i
        assert torch.equal(s.k[:, :, :at], kv), i


PROMPTS = [_toks(6, 11), _toks(3, 12), _toks(9, 13), _toks(4, 14)]
STOP = 2                        # stream 0 stops after 2 tokens: its slot is the first one freed
TURN2 = _toks(2, 15)            # the second turn's new tokens after stream 2's answer


@pytest.fixture(scope="module")
def first_wave(files):
    """-np 3: streams 0..2 start at steps 0, 1, 2 (prompts of 6, 3 and 9 rows), stream 0 stops
    after 2 tokens, stream 3 waits for a slot and takes the one stream 0 freed.
    -> (engine, tokens, runs, alone tokens)."""
    f = files["plain"]
    alone = _alone(f, PROMPTS, [STOP, N_NEW, N_NEW, N_NEW])
    e = _engine(f, 3)
    got, _, runs = drive(e, PROMPTS, N_NEW, stop_after={0: STOP}, stop_ids=NONE)
    return e, got, runs, alone


def test_streams_of_different_lengths_get_their_tokens_alone(first_wave):
    _, got, runs, alone = first_wave
    assert [got[i] for i in range(4)] == alone
    assert runs[3].slot is runs[0].slot                 # the freed slot, reset for a new prompt
    assert {len(r.rows) for r in runs} == {STOP - 1, N_NEW - 1} and all(r.rows[0] == 1 for r in runs)


def test_a_continued_conversation_reuses_its_slot(files, first_wave):
    """After the first wave, stream 2's conversation continues (its prompt, 1 token of its
    answer, 2 new ones) beside stream 1's prompt again: each lands in its old slot and re-uses
    its prompt up to its boundary checkpoint; both get the tokens a fresh one-slot engine gives."""
    e, _, first, alone = first_wave
    turn2 = PROMPTS[2] + alone[2][:1] + TURN2        # (its 2 answer rows cached: a point; 1 is not)
    fresh = _alone(files["plain"], [turn2])[0]
    again, gens, runs = drive(e, [turn2, PROMPTS[1]], N_NEW, starts=[0, 0], stop_ids=NONE)
    assert runs[0].slot is first[2].slot and runs[1].slot is first[1].slot
    assert gens[0].stats.prompt_reused == len(PROMPTS[2]) - 1     # back to the prompt boundary
    assert gens[1].stats.prompt_reused == len(PROMPTS[1]) - 1
    assert again[0] == fresh and again[1] == alone[1]


def test_ngram_drafts_in_shared_rounds_are_exact(files):
    """-np 2, the copy drafter ungated on a model that repeats what it saw (each prompt holds
    its own continuation): drafts ride and are accepted in the shared rounds, and each
    stream's tokens are its plain greedy tokens alone."""
    f = files["copying"]
    start = _toks(3, 21)
    cont = _alone(f, [start])[0]                           # what the model says after it
    prompts = [start + cont + start, start[1:] + cont + start[1:]]
    alone = _alone(f, prompts)
    got, gens, runs = drive(_engine(f, 2), prompts, N_NEW, SpecConfig("ngram", 4, 1, gate=False), starts=[0, 0],
                            stop_ids=NONE)
    assert [got[0], got[1]] == alone
    assert all(max(r.rows) > 1 for r in runs)                          # drafts rode in the rounds
    assert all(g.stats.draft_n_accepted > 0 for g in gens)

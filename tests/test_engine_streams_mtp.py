"""The MTP head at -np N (spec/mtp.py: a state per slot over one head; runtime/gpu_mtp.py: the
slots of one MTP cache, the row table). -np 3 through streams.Streams: prompts of 6, 4, 9 and 4
tokens started at different steps, stream 0 stopped after 2 tokens and its slot taken by stream
3, every stream drafting with the MTP head:

- `mtp` (every draft verified, the chain's at min-p 0), each stream scoring its own prompt's
  draft vocabulary (200 of the 260 rows: Cyrillic in one prompt, Han in another): each stream's
  tokens are its plain greedy tokens alone, and every chain it ran (tokens and probabilities,
  exactly) is the chain it runs alone on a one-slot engine: its drafts depend on its own
  history only (its slot's MTP entries, its vocabulary), whatever ran beside it or in its slot;
- `mtp,ngram` under the policy (a fixed cost table; each slot's policy memory its own):
  each stream's tokens are its plain greedy tokens alone.

On the GPU runtime (the interpreter here: fp32 GEMVs and small attention tiles; the MTP head's
table form against its one-slot scalar form) and on the CPU reference (a cache each)."""
from __future__ import annotations

import pytest
import torch

from alphallama.engine import Engine
from alphallama.gguf.arch import find_mtp_head
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.spec.config import SpecConfig
from alphallama.spec.draft_vocab import prompt_scripts
from alphallama.spec.gate import MAX_WIDTH, CostTable
from alphallama.spec.mtp import load_mtp_states, make_mtp_drafter
from alphallama.tokenizer import Tokenizer

from streamutil import drive

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX, STOP, DEPTH, VOCAB = 40, 2, 2, 200
N_NEW = {"gpu": 3, "reference": 8}     # each stream's tokens: the interpreter's time decides
NONE: set[int] = set()          # no end-of-generation token: every stream runs its max_tokens
FLAT = CostTable([1.0 + 0.05 * w for w in range(MAX_WIDTH)], MAX_WIDTH)   # the policy's prices


def _prompts(tok: Tokenizer) -> list[list[int]]:
    """Repeats (the copy finds matches); the second prompt has Cyrillic letters, the third Han."""
    g = torch.Generator().manual_seed(11)
    b = [torch.randint(tok.vocab_size, (n,), generator=g).tolist() for n in (3, 2)]
    cyr, han = tok.encode("да", add_special=False), tok.encode("中文", add_special=False)   # 4 and 6 bytes
    prompts = [b[0] * 2, cyr, han + b[0], b[1] * 2]
    scripts = [prompt_scripts(tok.decode(p, special=False)) for p in prompts]
    assert scripts[1] == ["cyrillic"] and scripts[2] == ["han"] and scripts[3] not in scripts[1:3]
    return prompts


class Recording:
    """A stream's spec: the MTP drafter alone (what SpecConfig("mtp", gate=False,
    mtp_switch=False) makes), recording each round's whole chain (tokens, probabilities)."""
    fast = False

    def __init__(self):
        self.chains: list[tuple[list[int], list[float]]] = []

    def make_drafter(self, engine, mtp=None, slot=None):
        d = make_mtp_drafter(engine, DEPTH, 0.0, mtp)
        propose = d.propose

        def recorded(max_n):
            draft = propose(max_n)
            self.chains.append((d.last_tokens, d.last_probs))
            return draft
        d.propose = recorded
        return d


@pytest.fixture(scope="module", params=["gpu", "reference"])
def made(request, tmp_path_factory):
    """(model, file, tokenizer, the prompts, each one's plain greedy tokens alone: N_NEW of them)."""
    path = tmp_path_factory.mktemp("m") / "m.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q8_0", seed=5, d_model=64, n_heads=2, n_kv_heads=1,
                                          head_dim=32, d_ff=128, vocab_size=260, mtp="dense"), path)
    f = GGUFFile(path)
    if request.param == "gpu":
        from alphallama.runtime.gpu_model import GPUModel
        from alphallama.runtime.overrides import Overrides
        model = GPUModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4)))
    else:
        model = load_model(f, CTX)
    made = (model, f, Tokenizer.from_metadata(f.metadata))
    prompts = _prompts(made[2])
    e = _engine(made, 1)
    plain = []
    for p in prompts:
        e.reset()
        plain.append(list(e.generate(p, N_NEW[request.param], stop_ids=NONE)))
    return (*made, prompts, plain)


def _engine(made, slots: int) -> Engine:
    """An engine of `slots` slots, each its own MTP state (the product's load_mtp_states)."""
    model, f, tok = made[:3]
    mtp = load_mtp_states(*find_mtp_head(f, model.cfg), model, CTX, tok, slots)
    return Engine(f, model, tok, None, CTX, mtp=mtp, slots=slots)


def test_mtp_chains_per_stream_are_its_chains_alone(made):
    prompts, plain = made[3:]
    solo, alone = _engine(made, 1), []
    solo.mtp.vocab.size = VOCAB
    for p, want in zip(prompts[1:], plain[1:]):       # stream 0 is stopped: its rooms are not a whole run's
        solo.reset()
        rec = Recording()
        assert list(solo.generate(p, len(want), spec=rec, stop_ids=NONE)) == want
        alone.append(rec.chains)
    e = _engine(made, 3)
    assert len({id(s.mtp) for s in e.slots}) == 3 and len({id(s.mtp.cache) for s in e.slots}) == 3
    e.mtp.vocab.size = VOCAB                          # (one vocabulary object, every slot's)
    recs = [Recording() for _ in prompts]
    got, _, runs = drive(e, prompts, len(plain[1]), recs, stop_after={0: STOP}, stop_ids=NONE)
    assert got == [plain[0][:STOP], *plain[1:]]
    assert runs[3].slot is runs[0].slot               # the freed slot: its MTP entries made again
    assert [r.chains for r in recs[1:]] == alone and all(alone)
    assert max(len(r.rows) for r in runs) > 1 and any(max(r.rows) > 1 for r in runs)   # drafts in shared rounds
    assert len({s.mtp.vocab_key for s in e.slots}) == 3


def test_mtp_ngram_in_shared_rounds_is_exact(made):
    prompts, plain = made[3:]
    e = _engine(made, 3)
    spec = SpecConfig("mtp,ngram", draft_max=4, ngram_min=1, gate=False, mtp_depth=DEPTH, mtp_min_p=0.0,
                      mtp_switch=False)
    spec.memory.for_engine(e, exact=True)[1].table = FLAT
    got, gens, _ = drive(e, prompts, len(plain[1]), spec, stop_after={0: STOP}, stop_ids=NONE)
    assert got == [plain[0][:STOP], *plain[1:]]
    assert all(g.stats.draft_n > 0 for g in gens[1:]), [g.spec for g in gens]
    assert sum(g.spec.rounds_by_source.get("mtp", 0) for g in gens) > 0

"""The hybrids' MTP head at -np 2 (spec/mtp.py's state per slot beside the hybrid's slots; on the
GPU runtime GPUHybridMTPHead over the slots of one MTP cache, GPUHybridModel over HybridSlots):
streams of 4, 2 and 3 prompt tokens through streams.Streams, stream 0 stopped after 2 tokens and
its slot taken by stream 2, each drafting with the in-file MTP head (every draft verified, the
chain's at min-p 0): each stream's tokens are its plain greedy tokens alone, and every chain it
ran (tokens and probabilities, exactly) is the chain it runs alone on a one-slot engine.

tests/runtime/test_gpu_hybrid.py's tiny qwen35 with its MTP block, on the GPU runtime (the
interpreter here: fp32 GEMVs, small attention tiles) and on the CPU reference (HybridTransformer,
a cache each)."""
from __future__ import annotations

import pytest
import torch

from alphallama.engine import Engine
from alphallama.gguf.arch import find_mtp_head
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.spec.mtp import load_mtp_states
from alphallama.tokenizer import Tokenizer
from tests.runtime.test_gpu_hybrid import TINY
from tests.test_engine_streams_mtp import NONE, STOP, Recording

from streamutil import drive

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 40
N_NEW = {"gpu": 3, "reference": 6}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["gpu", "reference"])
def made(request, tmp_path_factory):
    """(model, file, tokenizer, prompts)."""
    path = tmp_path_factory.mktemp("hmtp") / "qwen35-mtp.gguf"
    write_synthetic(PRESETS["tiny-qwen35"](**TINY, mtp="dense"), path)
    f = GGUFFile(path)
    if request.param == "gpu":
        from alphallama.runtime.gpu_hybrid import GPUHybridModel
        from alphallama.runtime.overrides import Overrides
        model = GPUHybridModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", moe_gemv="f32",
                                                                       attention_tiles=(16, 4)))
    else:
        model = load_model(f, CTX)
    g = torch.Generator().manual_seed(21)
    b = [torch.randint(TINY["vocab_size"], (n,), generator=g).tolist() for n in (2, 2, 3)]
    return model, f, Tokenizer.from_metadata(f.metadata), [b[0] * 2, b[1], b[2]], N_NEW[request.param]


def _engine(made, slots: int) -> Engine:
    model, f, tok = made[:3]
    mtp = load_mtp_states(*find_mtp_head(f, model.cfg), model, CTX, tok, slots)
    return Engine(f, model, tok, None, CTX, mtp=mtp, slots=slots)


def test_mtp_streams_get_their_tokens_and_chains_alone(made):
    prompts, n_new = made[3:]
    solo, plain, alone = _engine(made, 1), [], []
    for p in prompts:
        solo.reset()
        plain.append(list(solo.generate(p, n_new, stop_ids=NONE)))
    for p, want in zip(prompts[1:], plain[1:]):     # stream 0 is stopped: its rooms are not a whole run's
        solo.reset()
        rec = Recording()
        assert list(solo.generate(p, n_new, spec=rec, stop_ids=NONE)) == want
        alone.append(rec.chains)
    e = _engine(made, 2)
    recs = [Recording() for _ in prompts]
    got, _, runs = drive(e, prompts, n_new, recs, stop_after={0: STOP}, stop_ids=NONE)
    assert got == [plain[0][:STOP], *plain[1:]]
    assert runs[2].slot is runs[0].slot               # the freed slot: its state and MTP entries made again
    assert [r.chains for r in recs[1:]] == alone and all(alone)
    assert any(max(r.rows) > 1 for r in runs)         # drafts rode in the rounds

"""Penalties and logit_bias on both runtimes: the GPU runtime (GPUModel; the Triton kernels
in the interpreter on the CPU) and the CPU reference. Speculative greedy output with the
copy drafter equals plain greedy output with the same penalties, and parallel streams with
different penalties, decoded together in shared rounds, each get their tokens alone."""
from __future__ import annotations

import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.sampling import SamplingParams
from alphallama.spec.config import SpecConfig
from alphallama.streams import Streams
from alphallama.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX, N_NEW = 40, 12
NGRAM = SpecConfig("ngram", 4, 1, gate=False)
CASES = [SamplingParams(repeat_penalty=1.5, repeat_last_n=8),
         SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repeat_last_n=-1, logit_bias=((235, -3.0),))]


@pytest.fixture(scope="module", params=["gpu", "reference"])
def made(request, tmp_path_factory) -> tuple:
    """(the model, its file): the GPU runtime (small tiles, fp32 GEMVs: the interpreter's cost
    is per program) or the CPU reference, of a one-layer random-weight qwen3."""
    path = tmp_path_factory.mktemp("m") / "m.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q8_0", seed=5, d_model=64, n_heads=2, n_kv_heads=1,
                                          head_dim=32, d_ff=128, vocab_size=260), path)
    f = GGUFFile(path)
    if request.param == "gpu":
        from alphallama.runtime.gpu_model import GPUModel
        from alphallama.runtime.overrides import Overrides
        return GPUModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4))), f
    return load_model(f, CTX), f


def _engine(made, slots: int = 1) -> Engine:
    model, f = made
    return Engine(f, model, Tokenizer.from_metadata(f.metadata), None, CTX, slots=slots)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    base = [torch.randint(vocab, (n,), generator=g).tolist() for n in (4, 3, 5)]
    return [base[0] * 3, base[1] * 2 + [7], base[2] * 2]      # repeats: the copy drafter finds matches


def _alone(e: Engine, prompt: list[int], sampling: SamplingParams, spec=SpecConfig("none")) -> tuple[list, Generation]:
    e.reset()
    gen = Generation()
    return list(e.generate(prompt, N_NEW, sampling, stop_ids=set(), gen=gen, spec=spec)), gen


def test_spec_equals_plain_with_penalties(made):
    e = _engine(made)
    prompt = _prompts(e.cfg.vocab_size)[0]
    none, _ = _alone(e, prompt, SamplingParams())
    for sampling in CASES:
        plain, _ = _alone(e, prompt, sampling)
        drafted, gen = _alone(e, prompt, sampling, NGRAM)
        assert drafted == plain and plain != none
        assert gen.stats.draft_n_accepted > 0


def test_streams_with_different_penalties_get_their_tokens_alone(made):
    e = _engine(made, slots=3)
    prompts, samplings = _prompts(e.cfg.vocab_size), [SamplingParams(), *CASES]
    alone = [_alone(_engine(made), p, s)[0] for p, s in zip(prompts, samplings)]
    streams = Streams(e)
    got: list[list[int]] = [[] for _ in prompts]
    for i, (p, s) in enumerate(zip(prompts, samplings)):
        streams.add(p, N_NEW, lambda t, i=i: got[i].append(t) is None, sampling=s, stop_ids=set(), spec=NGRAM)
    runs = list(streams.runs)
    while streams.runs:
        assert all(r.error is None for r in streams.step())
    assert got == alone
    assert max(max(r.rows) for r in runs) > 1          # drafts rode in the shared rounds

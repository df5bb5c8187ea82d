"""The GPU MTP head (Triton kernels; interpreter on CPU) against the reference MTP block:
the same entries and the same chain of drafts over a whole vocabulary and over a
draft-vocabulary subset, and exact decoding with MTP drafts on the GPU runtime; the slots of
one MTP cache (parallel streams) give each stream its chains alone, bit for bit."""
from __future__ import annotations


import pytest
import torch


from alphallama.chat import ChatTemplate  # noqa: E402
from alphallama.engine import Engine, Generation  # noqa: E402
from alphallama.gguf.arch import find_mtp_head, load_config  # noqa: E402
from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_mtp_sidecar, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.model.mtp import MTPHead  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from alphallama.runtime.gpu_mtp import GPUMTPHead, pick, pick_ref  # noqa: E402
from alphallama.runtime.overrides import Overrides  # noqa: E402
from alphallama.spec.mtp import MTPState, make_mtp_drafter  # noqa: E402
from alphallama.tokenizer import Tokenizer  # noqa: E402
from gpucheck import chains_follow, slots_follow_alone  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 64


def _build(tmp_path_factory, preset, quant, ffn):
    path = tmp_path_factory.mktemp("m") / f"{preset}.gguf"
    spec = PRESETS[preset](n_layers=1, quant=quant, seed=11, mtp=None)
    write_synthetic(spec, path)
    write_mtp_sidecar(PRESETS[preset](n_layers=1, quant=quant, seed=11, mtp=ffn), path.with_suffix(".mtp.gguf"))
    f = GGUFFile(path)
    head_file, hc = find_mtp_head(f, load_config(f))
    ref = load_model(f, CTX)
    gpu = GPUModel(f, CTX, device=DEV)
    # graphs asked for everywhere: on CUDA they are captured; on CPU capture fails and the
    # head falls back to running eagerly (the path a failed capture takes on a GPU)
    return f, ref, MTPHead.load(head_file, hc, ref, CTX), gpu, GPUMTPHead(gpu, head_file, hc, CTX, graphs=True)


@pytest.fixture(scope="module", params=[("tiny-qwen2", "Q8_0", "dense"), ("tiny-qwen3moe", "Q4_K", "moe")],
                ids=lambda p: f"{p[0]}-{p[2]}")
def heads(request, tmp_path_factory):
    return _build(tmp_path_factory, *request.param)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _build(tmp_path_factory, "tiny-qwen3", "Q8_0", "dense")


@pytest.mark.parametrize("S", [7, 4096, 9000])
def test_pick_kernel(S):
    """argmax (first of ties) and its softmax probability in one kernel, across blocks."""
    gen = torch.Generator().manual_seed(S)
    ids = torch.randperm(3 * S, generator=gen)[:S].to(DEV)
    for case in range(3):
        logits = (4 * torch.randn(1, S, generator=gen)).to(DEV)
        if case == 1:                                   # a tie: the first index wins
            logits[0, S // 3] = logits[0, S - 1] = logits.max() + 1
        if case == 2:                                   # the maximum in the last, partial block
            logits[0, S - 1] = logits.max() + 0.5
        out = torch.full((4,), -1.0, dtype=torch.float64, device=DEV)
        tok = pick(logits, ids, out, 1)
        want_tok, want_p = pick_ref(logits.cpu(), ids.cpu())
        assert int(tok) == want_tok == int(out[1])
        assert float(out[3]) == pytest.approx(want_p, rel=1e-5)
        assert float(out[0]) == float(out[2]) == -1.0   # other slots untouched


def test_chain_matches_reference(heads):
    _, ref, rhead, _, ghead = heads
    V, D = ref.cfg.vocab_size, ref.cfg.d_model
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, V, (5,), generator=gen)
    g = torch.cat([torch.zeros(1, D), torch.randn(4, D, generator=gen)])
    chains_follow(rhead, ghead, g, toks, 2, V, CTX, DEV)      # then over the odd ids, a chain of 1


def test_exact_decoding_with_mtp_on_the_gpu_runtime(dense):
    f, _, _, gpu, ghead = dense
    tok = Tokenizer.from_metadata(f.metadata)
    engine = Engine(f, gpu, tok, ChatTemplate.from_gguf_metadata(f.metadata), CTX,
                    mtp=MTPState(ghead, CTX, tok))

    class Spec:
        fast = False

        def make_drafter(self, e, mtp=None, slot=None):
            return make_mtp_drafter(e, 2, 0.0, mtp)

    prompt = [5, 9]                      # small: every kernel runs in the interpreter on CPU
    g0, g1 = Generation(), Generation()
    plain = list(engine.generate(prompt, 3, gen=g0))
    mtp = list(engine.generate(prompt, 3, gen=g1, spec=Spec()))
    assert mtp == plain and g1.stats.draft_n > 0


def test_slots_give_each_stream_its_chains_alone(tmp_path):
    """Three streams (entries of 3, 1 and 2 rows, then chains after 2 and 1 staged rows each) in
    the slots of one MTP cache, their steps interleaved: the chains and entries each gets alone
    (gpucheck.slots_follow_alone). A small head (d_model 64, small attention tiles): the
    interpreter's time."""
    path = tmp_path / "small.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q8_0", seed=5, d_model=64, n_heads=2, n_kv_heads=1,
                                          head_dim=32, d_ff=128, vocab_size=260, mtp="dense"), path)
    f = GGUFFile(path)
    gpu = GPUModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4)))
    head = GPUMTPHead(gpu, *find_mtp_head(f, load_config(f)), CTX, graphs=True)
    D, V = gpu.cfg.d_model, gpu.cfg.vocab_size
    gen = torch.Generator().manual_seed(4)
    g, toks = torch.randn(15, D, generator=gen), torch.randint(0, V, (15,), generator=gen)
    g[[0, 6, 10]] = 0                                    # no state before a stream's position 0
    slots_follow_alone(head, g, toks, [(0, 3, 5), (6, 1, 3), (10, 2, 3)], 2, CTX, DEV)

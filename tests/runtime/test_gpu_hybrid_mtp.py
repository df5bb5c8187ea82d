"""The hybrids' in-file MTP head on the GPU runtime (runtime/hybrid_mtp.py; Triton kernels, the
interpreter on CPU) against the float32 reference head (model/qwen35_mtp.py): the entries'
logits, then a chain of drafts (tokens and probabilities) over the whole vocabulary and over a
draft vocabulary; the slots of one MTP cache (parallel streams) give each stream its entries and
chains alone, bit for bit; and through the engine beside GPUHybridModel, exact mode with the MTP
drafter and with MTP + the copy drafter gives plain greedy's tokens, over a second turn too.

The files: test_gpu_hybrid.py's tiny shapes (2 layers, d_model 64, Q8_0) with an MTP block
(blk.2: a gated attention block with the model's FFN kind)."""
from __future__ import annotations


import pytest
import torch


from gpucheck import TOL as GPU_TOL
from gpucheck import chains_follow, slots_follow_alone

from alphallama.gguf.arch import find_mtp_head, load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.kernels.gemv.qmatmul import qmatmul
from alphallama.model.loader import load_model
from alphallama.model.qwen35_mtp import HybridMTPHead
from alphallama.runtime.gpu_hybrid import GPUHybridModel
from alphallama.runtime.hybrid_mtp import GPUHybridMTPHead
from alphallama.runtime.overrides import Overrides
from alphallama.spec.mtp import load_mtp_states

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 48
TOL = 2e-3 if DEV == "cpu" else GPU_TOL     # of the largest logit, as test_gpu_hybrid.py
TINY = {"n_layers": 2, "full_attention_interval": 2, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32,
        "d_ff": 64, "vocab_size": 288, "ssm_head_dim": 32, "rope_dim": 16, "quant": "Q8_0", "seed": 5}
MOE = {"n_experts": 4, "n_experts_used": 2, "d_ff_expert": 64, "d_ff_shared": 64}
ARCHS = {"tiny-qwen35": ({}, "dense"), "tiny-qwen3next": (MOE, "moe")}    # qwen3next: tied head, plain partial rope
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(ARCHS))
def heads(request, tmp_path_factory):
    kw, ffn = ARCHS[request.param]
    path = tmp_path_factory.mktemp("hmtp") / f"{request.param}.gguf"
    write_synthetic(PRESETS[request.param](**TINY, **kw, mtp=ffn), path)
    f = GGUFFile(path)
    head_file, hc = find_mtp_head(f, load_config(f))
    ref = load_model(f, CTX)
    gpu = GPUHybridModel(f, CTX, device=DEV)
    # graphs asked for everywhere: captured on CUDA; on the CPU the capture fails and the head runs eagerly
    return HybridMTPHead.load(head_file, hc, ref, CTX), GPUHybridMTPHead(gpu, head_file, hc, CTX, graphs=True)


def _inputs(D: int, V: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.cat([torch.zeros(1, D), 2 * torch.randn(m - 1, D, generator=gen)])   # no state before position 0
    return g, torch.randint(0, V, (m,), generator=gen)


def test_entries_logits_follow_the_reference(heads):
    """Five depth-1 entries in one block (output_norm of the main model's rows, the gated attention
    with its partial / sectioned rope over the head's cache, the FFN): the logits of
    shared_head_norm(h') within TOL of the reference head's at every entry."""
    rhead, ghead = heads
    c = rhead.cfg
    g, toks = _inputs(c.d_model, c.vocab_size, 5, 0)
    lr = rhead.logits(rhead.extend(g, toks, 0, rhead.new_cache(CTX)))                     # [5, V]
    cache = ghead.new_cache(CTX)
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    hn, _ = ghead._block(ghead._entry(g.to(DEV)), toks.to(DEV), pos, cache)
    lg = qmatmul(hn, ghead.scored)                                                         # [5, V]
    torch.testing.assert_close(lg.cpu(), lr, atol=TOL * lr.abs().max().item(), rtol=0)
    # control: without the depth-1 output_norm (GPUMTPHead's feed) the logits are far outside TOL.
    # Only the norm's weight tells the two apart (the head's hnorm undoes its scale): 1.7% of the
    # largest logit here, inside the GPU's bf16 tolerance (4%; H100 2026-12-06), so the float32
    # interpreter run is the one that proves the feed
    if DEV == "cpu":
        other, _ = ghead._block(g.to(DEV), toks.to(DEV), pos, ghead.new_cache(CTX))
        assert (qmatmul(other, ghead.scored).cpu() - lr).abs().max() > 5 * TOL * lr.abs().max()


def test_chain_matches_the_reference(heads):
    """extend 3 entries, then 2 staged rows and a chain of 3 drafts (deeper entries fed
    shared_head_norm(h')): the reference's tokens, their probabilities within 2e-3; then over a
    draft vocabulary (the odd ids) a chain of 2."""
    rhead, ghead = heads
    c = rhead.cfg
    g, toks = _inputs(c.d_model, c.vocab_size, 5, 1)
    chains_follow(rhead, ghead, g, toks, 3, c.vocab_size, CTX, DEV)


def test_slots_give_each_stream_its_chains_alone(tmp_path):
    """qwen35's head (the gated attention block: its partial rope from the row table) over three
    streams in the slots of one MTP cache, their steps interleaved: each stream's chains and
    entries are its own alone (gpucheck.slots_follow_alone). fp32 GEMVs and small attention tiles:
    the interpreter's time."""
    path = tmp_path / "qwen35-mtp.gguf"
    write_synthetic(PRESETS["tiny-qwen35"](**TINY, mtp="dense"), path)
    f = GGUFFile(path)
    gpu = GPUHybridModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", moe_gemv="f32",
                                                                 attention_tiles=(16, 4)))
    head = GPUHybridMTPHead(gpu, *find_mtp_head(f, load_config(f)), CTX, graphs=True)
    g, toks = _inputs(gpu.cfg.d_model, gpu.cfg.vocab_size, 15, 2)
    g[[6, 10]] = 0                                       # no state before a stream's position 0
    slots_follow_alone(head, g, toks, [(0, 3, 5), (6, 1, 3), (10, 2, 3)], 2, CTX, DEV)


def test_exact_mtp_and_mtp_ngram_through_the_engine(tmp_path):
    """qwen35 with its MTP head through the engine (load_mtp_states picks GPUHybridMTPHead beside
    GPUHybridModel; fp32 activations: half the interpreter's time, test_gpu_hybrid.py runs the
    product's kernels through the engine). The random head drafts every round (min-p 0) and is
    wrong: rounds committed to fewer rows than they verified, the head's entries staged from the
    committed rows. Exact mode gives plain greedy's tokens with `mtp` and with `mtp,ngram` (the
    policy priced by a fixed table, as tests/spec/test_policy.py does), the second request keeping
    the cache the first left (the model's rows to the prompt's checkpoint, the head's entries:
    MTPState.keep_rows)."""
    from alphallama.engine import Engine, Generation
    from alphallama.spec.config import SpecConfig
    from alphallama.spec.gate import CostTable
    from alphallama.tokenizer import Tokenizer
    path = tmp_path / "qwen35-mtp.gguf"
    write_synthetic(PRESETS["tiny-qwen35"](**TINY, mtp="dense"), path)
    f = GGUFFile(path)
    gpu = GPUHybridModel(f, CTX, device=DEV, overrides=Overrides(decode_gemv="f32", moe_gemv="f32"))
    tok = Tokenizer.from_metadata(f.metadata)
    mtp, = load_mtp_states(*find_mtp_head(f, load_config(f)), gpu, CTX, tok)
    assert type(mtp.head) is GPUHybridMTPHead
    engine = Engine(f, gpu, tok, None, CTX, mtp=mtp)
    stop: set[int] = set()
    prompt = [7, 3, 7, 3, 7]
    plain = list(engine.generate(prompt, 4, stop_ids=stop))
    for kind in ("mtp", "mtp,ngram"):
        spec = SpecConfig(kind, draft_max=4, ngram_min=2, gate=False, mtp_depth=2, mtp_min_p=0.0, mtp_switch=False)
        spec.memory.for_engine(engine, exact=True)[1].table = CostTable([1.0 + 0.05 * w for w in range(64)], 64)
        g = Generation()
        assert list(engine.generate(prompt, 4, gen=g, spec=spec, stop_ids=stop)) == plain
        assert g.spec.rounds_by_source.get("mtp", 0) > 0, g.spec
    # the first MTP request made the head's entries of the whole prompt; the second kept them
    assert g.stats.prompt_reused == len(prompt) - 1, g.stats

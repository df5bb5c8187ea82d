"""Fast mode's hybrid on the GPU runtime (GPUModel(fast=True), MmaChoice "dp4a"): rounds of
up to engine.fast_mma_narrow rows are the default model's bits, wider ones the tensor-core
family's (engine.gemv_mma), and an exact verify on such a model still gives plain
decoding's rows. Runs on the CPU under TRITON_INTERPRET=1 (the mma emulated) and on CUDA."""
from __future__ import annotations


import pytest
import torch


from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from alphallama.runtime.overrides import PRODUCT, Overrides  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NARROW = PRODUCT.fast_mma_narrow


def _model(tmp_path_factory, preset: str) -> GGUFFile:
    path = tmp_path_factory.mktemp("fast") / "m.gguf"
    # head_dim 128: the attention combine emits o's q8_K activations in the wide rounds
    write_synthetic(PRESETS[preset](n_layers=1, quant="Q4_K", seed=29, n_heads=4, head_dim=128), path)
    return GGUFFile(path)


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    return _model(tmp_path_factory, "tiny-qwen3")


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwen3moe"])
def q4k_any(request, tmp_path_factory):
    """A dense model, and an MoE one (its o adds into the residual and its FFN norm computes
    the router's logits in the narrow rounds only: engine.norm_router needs o on dp4a)."""
    return _model(tmp_path_factory, request.param)


def _logits(model: GPUModel, toks: torch.Tensor, exact: bool | None = None) -> torch.Tensor:
    cache = model.new_cache(64)
    if exact is None:
        return model.forward(toks, 0, cache)[0].clone()
    return model.verify(toks, 0, cache, exact=exact)[0].clone()


def test_narrow_rounds_are_the_defaults_and_wide_ones_the_tensor_cores(q4k_any):
    q4k = q4k_any
    toks = torch.randint(0, 64, (NARROW + 1,), generator=torch.Generator().manual_seed(29))
    fast = GPUModel(q4k, 64, device=DEV, fast=True)
    plain = GPUModel(q4k, 64, device=DEV)
    family = GPUModel(q4k, 64, device=DEV, overrides=Overrides(gemv_mma=True, gemv_mma_narrow=NARROW))
    assert fast.hybrid and not plain.hybrid and not family.hybrid
    L = fast.layers[0]
    assert any(L.o.mma) and L.o.adds(1) and not L.o.adds(NARROW + 1)   # o adds/splits as dp4a when narrow
    if L.moe is not None:
        assert fast._norm_router(L, NARROW) and not fast._norm_router(L, NARROW + 1)
    narrow, wide = toks[:NARROW], toks
    cache = plain.new_cache(64)
    plain_narrow = plain.forward(narrow, 0, cache)[0].clone()
    # plain decoding's rows (row-invariant): the narrow round, then the last row alone
    plain_wide = torch.cat([plain_narrow, plain.forward(wide[NARROW:], NARROW, cache)[0]])   # [NARROW + 1, V]
    assert torch.equal(_logits(fast, narrow), plain_narrow)                  # plain decode's bits, W = 1.. narrow
    fast_wide = _logits(fast, wide, exact=False)                             # a fast verify round (a forward)
    assert torch.equal(fast_wide, _logits(family, wide))                     # the mma family's bits, wider
    assert not torch.equal(fast_wide, plain_wide)                            # (so the rows differ: fast only)
    ref = load_model(q4k, 64)
    lr, _ = ref.forward(toks, 0, ref.new_cache(64))
    torch.testing.assert_close(fast_wide.cpu(), lr, atol=5e-2 * lr.abs().max().item(), rtol=0)
    # an exact verify on the hybrid runs its rows one at a time: plain decoding's rows, bit for bit
    assert torch.equal(_logits(fast, wide, exact=True), plain_wide)


def test_exact_speculation_on_a_fast_model_is_plain_greedy(q4k):
    """An engine built for fast mode asked for exact speculation: the copy drafter's
    drafts are verified row by row, and the tokens are plain greedy's."""
    from alphallama.engine import Engine, Generation
    from alphallama.spec.config import SpecConfig
    from alphallama.tokenizer import Tokenizer
    gpu = GPUModel(q4k, 128, device=DEV, fast=True)
    engine = Engine(q4k, gpu, Tokenizer.from_metadata(q4k.metadata), None, 128)
    base = torch.randint(gpu.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(31)).tolist()
    prompt = base * 3                   # repeats for the copy drafter (and a random tiny model soon loops)
    g0, g1 = Generation(), Generation()
    plain = list(engine.generate(prompt, 8, gen=g0))
    engine.reset()
    spec = list(engine.generate(prompt, 8, gen=g1, spec=SpecConfig("ngram", 8, 1, gate=False)))
    assert spec == plain and len(plain) == 8 and g1.stats.draft_n > 0

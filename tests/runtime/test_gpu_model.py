"""The GPU runtime's forward (Triton kernels; interpreter on CPU) against the reference
transformer, and its row invariance: a round of W rows equals W single-row rounds."""
from __future__ import annotations


import pytest
import torch


from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from alphallama.runtime.overrides import Overrides  # noqa: E402
from gpucheck import follows_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# a dense and an MoE model (tiny-qwen2 and tiny-qwen3, dense Q4_K among their types, are the golden
# records' presets: test_golden.py checks their values and every width's bits)
@pytest.fixture(scope="module", params=[("tiny-llama", "Q6_K"), ("tiny-qwen3moe", "Q4_K")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def models(request, tmp_path_factory):
    preset, quant = request.param
    path = tmp_path_factory.mktemp("m") / f"{preset}.gguf"
    write_synthetic(PRESETS[preset](n_layers=1, quant=quant, seed=3), path)
    f = GGUFFile(path)
    return load_model(f, 128), GPUModel(f, 128, device=DEV)


def test_logits_match_reference(models):
    ref, gpu = models
    toks = torch.randint(0, ref.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    lr, _ = ref.forward(toks, 0, ref.new_cache(128))
    lg, _ = gpu.forward(toks, 0, gpu.new_cache(128))
    # fp16 K/V and fp16 attention inputs against an fp32 reference; the dense GEMVs take
    # int8 activations (one scale per 32 values, as llama.cpp's q8_1: kernels/gemv/qgemv_i8.py),
    # a relative error of up to 2**-8 per activation, so 4% of the largest logit
    atol = 4e-2 * lr.abs().max().item()
    torch.testing.assert_close(lg.cpu(), lr, atol=atol, rtol=0)
    # the same argmax wherever the reference's top two are further apart than twice that
    top2 = lr.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert clear.any()
    assert torch.equal(lg.argmax(-1).cpu()[clear], lr.argmax(-1)[clear])


def test_moe_on_int8_activations(tmp_path):
    """The routed experts on int8 activations (moe_gemv "i8") against the reference, and
    a round equal to its rows run alone."""
    path = tmp_path / "moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=1, quant="Q4_K", seed=3), path)
    f = GGUFFile(path)
    ref, gpu = load_model(f, 128), GPUModel(f, 128, device=DEV, overrides=Overrides(moe_gemv="i8"))
    assert all(L.moe.i8 for L in gpu.layers)
    toks = torch.randint(0, ref.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    follows_reference(ref, gpu, toks, 128, alone_from=2)


def test_round_equals_single_rows(models):
    _, gpu = models
    cache = gpu.new_cache(128)
    gpu.forward(torch.tensor([1, 2, 3, 4]), 0, cache)
    rows = torch.tensor([7, 8, 9])
    a, ha = gpu.verify(rows, 4, cache)
    a, ha = a.clone(), ha.clone()
    cache.truncate(4)
    singles = [tuple(t.clone() for t in gpu.forward(rows[i:i + 1], 4 + i, cache)) for i in range(3)]   # graph outputs are static buffers
    assert torch.equal(a, torch.cat([s[0] for s in singles]))
    assert torch.equal(ha, torch.cat([s[1] for s in singles]))


def test_moe_ranks_summed_in_the_next_norm_give_the_same_bits(tmp_path, monkeypatch):
    """engine.combine_in_norm: the MoE layers return their ranks unsummed and the next
    norm sums them (no combine launch): the logits are the combine kernel's path's bit for
    bit, no combine launch runs, and a round still equals its rows run alone."""
    from alphallama.kernels.moe import moe_i8
    path = tmp_path / "moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=1, quant="Q4_K", seed=6), path)
    f = GGUFFile(path)
    toks = torch.randint(0, 200, (3,), generator=torch.Generator().manual_seed(2))
    launches = []
    real = moe_i8.down_combine_kernel
    monkeypatch.setattr(moe_i8, "down_combine_kernel", type("K", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or real[grid]})())
    logits = {}
    for fused in (False, True):
        launches.clear()
        gpu = GPUModel(f, 128, device=DEV, graphs=False, overrides=Overrides(moe_gemv="i8", combine_in_norm=fused))
        cache = gpu.new_cache(128)
        logits[fused] = gpu.forward(toks, 0, cache)[0].clone()
        assert (len(launches) == 0) == fused
        if fused:
            cache.truncate(2)
            assert torch.equal(gpu.forward(toks[2:], 2, cache)[0], logits[True][2:])   # the last row alone
    assert torch.equal(logits[True], logits[False])


def _option_on_and_off(tmp_path, option: str, seed: int, applies, preset: str = "tiny-qwen3moe",
                       quant: str = "Q4_K", n_layers: int = 1, extra: dict | None = None,
                       **shape) -> dict[bool, torch.Tensor]:
    """A tiny model's logits (3 rows; by default MoE; `shape`: preset overrides) with an
    engine option off and on (`extra`: more engine options, both times): each against the
    reference; on, a round equals its last row run alone; applies(gpu) says whether the
    option took effect."""
    path = tmp_path / "moe.gguf"
    write_synthetic(PRESETS[preset](n_layers=n_layers, quant=quant, seed=seed, **shape), path)
    f = GGUFFile(path)
    ref = load_model(f, 128)
    toks = torch.randint(0, ref.cfg.vocab_size, (3,), generator=torch.Generator().manual_seed(seed))
    lr, _ = ref.forward(toks, 0, ref.new_cache(128))
    logits = {}
    for on in (False, True):
        gpu = GPUModel(f, 128, device=DEV, overrides=Overrides(moe_gemv="i8", **{option: on}, **(extra or {})))
        assert applies(gpu) == on
        cache = gpu.new_cache(128)
        logits[on] = gpu.forward(toks, 0, cache)[0].clone()
        torch.testing.assert_close(logits[on].cpu(), lr, atol=4e-2 * lr.abs().max().item(), rtol=0)
        if on:
            cache.truncate(2)
            assert torch.equal(gpu.forward(toks[2:], 2, cache)[0], logits[on][2:])   # the last row alone
    return logits


def test_moe_norm_computing_the_router_logits(tmp_path):
    """engine.norm_router: the o GEMV adds into the residual and the FFN norm computes the
    router's logits (one launch fewer a MoE layer): against the reference, close to the
    router-GEMV model, and a round equals its rows alone."""
    logits = _option_on_and_off(tmp_path, "norm_router", 9, lambda g: all(g._norm_router(L, 1) for L in g.layers))
    torch.testing.assert_close(logits[True], logits[False], atol=1e-3 * logits[False].abs().max().item(), rtol=0)


# a dense model's o and down (Q6_K) and an MoE model's o through the router norm (Q4_K): the
# split is the same code for every type (tiny-qwen3 Q4_K was a third case: CI time)
@pytest.mark.parametrize("preset,quant", [("tiny-llama", "Q6_K"), ("tiny-qwen3moe", "Q4_K")])
def test_o_and_down_in_runs_added_by_the_norm(tmp_path, preset, quant):
    """engine.gemv_split: the o and dense down GEMVs cut their slots into 2 runs and the
    next norm adds the partials (the MoE model's through the norm that computes the router
    logits, into a new residual tensor). Thresholds lowered so the tiny weights split:
    against the reference, close to the unsplit model, a round equals its rows alone."""

    def split(gpu) -> bool:
        runs = [L.o.runs(1) for L in gpu.layers] + [L.down.runs(1) for L in gpu.layers if L.down is not None]
        assert len(set(runs)) == 1, runs
        return runs[0] == 2
    # 8 heads: the o's rows of 512 values are 2 whole blocks of every quant, so they split too
    logits = _option_on_and_off(tmp_path, "gemv_split", 13, split, preset, quant, n_layers=2, n_heads=8,
                                extra={"split_limits": (1, 1 << 30)})
    torch.testing.assert_close(logits[True], logits[False], atol=1e-3 * logits[False].abs().max().item(), rtol=0)



@pytest.mark.parametrize("narrow", [0, 1])
def test_dense_weights_on_the_tensor_cores(tmp_path, narrow):
    """engine.gemv_mma: the Q4_K dense weights through qgemv_mma_k (its mma emulated under
    the interpreter), on activations with one scale a super-block that their Linear
    prepares: against the reference, near the dp4a model (the coarser activation scale is
    the gap), a round equals its rows alone. narrow 1: the 3-row round on the mma, the row
    alone on qgemv_q8k (dp4a): still equal, bit for bit."""
    def on(gpu) -> bool:
        return any(m for L in gpu.layers for lin in (L.qkv, L.o, L.gate_up, L.down) for m in lin.mma)
    logits = _option_on_and_off(tmp_path, "gemv_mma", 17, on, "tiny-qwen3", "Q4_K", n_layers=2,
                                extra={"gemv_mma_narrow": narrow}, n_heads=8)
    torch.testing.assert_close(logits[True], logits[False], atol=5e-2 * logits[False].abs().max().item(), rtol=0)


def test_narrow_rounds_give_the_tensor_cores_bits(tmp_path):
    """engine.gemv_mma_narrow: a 3-row round through qgemv_q8k (narrow 4) and through the mma
    (narrow 0) give the same logits, bit for bit: exact mode may pick the kernel by width.
    The producers emit the q8_K activations (the norms, the SiLU, the attention combine)."""
    from alphallama.kernels.gemv.q8k_act import Q8K
    path = tmp_path / "m.gguf"
    # head_dim 128: the attention combine emits o's q8_K activations, two heads a program
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=2, quant="Q4_K", seed=19, n_heads=4, head_dim=128), path)
    f = GGUFFile(path)
    toks = torch.randint(0, 64, (3,), generator=torch.Generator().manual_seed(19))
    out = {}
    for narrow in (0, 4):
        gpu = GPUModel(f, 128, device=DEV, overrides=Overrides(gemv_mma=True, gemv_mma_narrow=narrow))
        L = gpu.layers[0]
        assert any(L.gate_up.mma) and gpu._fuse_q8
        assert all(Q8K in lin.orders(3) for lin in (L.qkv, L.gate_up, L.o))   # their producers emit them
        out[narrow] = gpu.forward(toks, 0, gpu.new_cache(128))[0].clone()
    assert torch.equal(out[0], out[4])
    ref = load_model(f, 128)
    lr, _ = ref.forward(toks, 0, ref.new_cache(128))
    torch.testing.assert_close(out[4].cpu(), lr, atol=4e-2 * lr.abs().max().item(), rtol=0)


def test_exact_speculation_with_the_kernel_chosen_by_width(tmp_path):
    """engine.gemv_mma with narrow 1: plain rounds (W = 1) on the dp4a q8_K kernels, verify
    rounds (W > 1) on the tensor-core one (Q4_K): n-gram speculation in exact mode
    gives plain greedy's tokens, with drafts verified."""
    from alphallama.engine import Engine, Generation
    from alphallama.spec.config import SpecConfig
    from alphallama.tokenizer import Tokenizer
    path = tmp_path / "m.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, quant="Q4_K", seed=23, n_heads=4, head_dim=128), path)
    f = GGUFFile(path)
    # small attention tiles: the interpreter's cost is per program (the tiles decide no token here)
    gpu = GPUModel(f, 128, device=DEV, overrides=Overrides(gemv_mma=True, gemv_mma_narrow=1, attention_tiles=(16, 4)))
    assert any(gpu.layers[0].qkv.mma)
    engine = Engine(f, gpu, Tokenizer.from_metadata(f.metadata), None, 128)
    base = torch.randint(gpu.cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(23)).tolist()
    prompt = base * 2                   # repeats for the copy drafter (short: the mma is emulated on CPU)
    g0, g1 = Generation(), Generation()
    plain = list(engine.generate(prompt, 6, gen=g0))
    engine.reset()
    spec = list(engine.generate(prompt, 6, gen=g1, spec=SpecConfig("ngram", 8, 1, gate=False)))
    assert spec == plain and len(plain) == 6 and g1.stats.draft_n > 0

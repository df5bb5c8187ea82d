"""An expert store on the Gated DeltaNet hybrids' GPU runtime (runtime/gpu_hybrid.py through
runtime/store_rounds.py, the code GPUModel's store runs on): the qwen35moe block's routed
experts in a bank of VRAM slots and a host tier (the shared expert and an in-file MTP block
stay resident). As for GPUModel (test_store.py), a token's bits do not depend on where an
expert lives: without CPU workers the store runs the resident kernels (the reference is the
model without a store), with them the expert contract (the reference is the store with every
expert in the bank); exact speculation equals plain greedy with admissions happening; the
plan counts a hybrid's cache as attention K/V plus recurrent state."""
from __future__ import annotations

import os

import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.runtime.gpu_hybrid import GPUHybridModel
from alphallama.runtime.overrides import Overrides
from tests.offload.test_store import _teacher_forced
from tests.runtime.test_gpu_hybrid import MOE, TINY, _copying

F32 = Overrides(decode_gemv="f32", moe_gemv="f32")
CTX = 96
TOKENS = [5, 9, 100, 7, 42, 3, 250, 17]
# the models are CPU-device ones (device="cpu"): their kernels run only in the interpreter, which
# tests/conftest.py turns on where there is no GPU (on a GPU machine: TRITON_INTERPRET=1)
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a CPU-device model: needs the Triton interpreter (TRITON_INTERPRET=1)")]


@pytest.fixture(scope="module")
def hybrid_moe(tmp_path_factory) -> GGUFFile:
    """Q8_0 experts (a type of the expert contract: the CPU workers take them)."""
    path = tmp_path_factory.mktemp("hybrid-store") / "qwen35moe.gguf"
    write_synthetic(PRESETS["tiny-qwen35moe"](**TINY, **MOE), path)
    return GGUFFile(path)


@pytest.fixture(scope="module")
def copying(tmp_path_factory) -> GGUFFile:
    """A model that repeats what it saw (test_gpu_hybrid._copying: F32 down experts, so over
    PCIe only): the copy drafter's drafts are accepted."""
    path = tmp_path_factory.mktemp("hybrid-store") / "copying-qwen35moe.gguf"
    write_synthetic(_copying(PRESETS["tiny-qwen35moe"](**TINY, **MOE)), path)
    return GGUFFile(path)


def _model(f: GGUFFile, slots: int | None = None, cpu_tier: bool = False) -> GPUHybridModel:
    return GPUHybridModel(f, CTX, device="cpu", overrides=F32, expert_slots=slots, cpu_tier=cpu_tier)


@pytest.mark.parametrize("cpu_tier", [False, True], ids=["pcie", "cpu-workers"])
def test_logits_identical_whichever_tier(hybrid_moe, cpu_tier):
    n_experts = TINY["n_layers"] * MOE["n_experts"]
    if cpu_tier:
        full = _model(hybrid_moe, n_experts, cpu_tier=True)
        if full.cpu_link is None:
            pytest.skip("no CPU workers here (no C compiler)")   # (the contract takes Q8_0 and SiLU)
        ref = _teacher_forced(full, TOKENS[:5])
        assert int(full.cpu_link.seq.item()) == 0             # all in the bank: nothing was posted
    else:
        ref = _teacher_forced(_model(hybrid_moe), TOKENS[:5])
    for slots in (0, 3):   # every expert in the host tier; a mix
        m = _model(hybrid_moe, slots, cpu_tier)
        m.store.admit_bytes_per_round = 0                       # the start layout throughout
        assert m.store.slots == slots and int((m.store.table >= 0).sum()) == slots
        got = _teacher_forced(m, TOKENS[:5])
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"slots={slots}"
        assert m.store.stats.rounds >= 2                       # every round went through the store's hooks
        if cpu_tier:   # the host pairs were the workers': with no bank, every MoE layer of every round posted
            posts = int(m.cpu_link.seq.item())
            assert posts == 3 * TINY["n_layers"] if slots == 0 else 0 < posts <= 3 * TINY["n_layers"]


def test_exact_speculation_with_admissions(copying):
    """n-gram drafts verified through a store of 3 slots whose bank changes mid-run: the tokens
    of plain greedy on the same store, and of the resident model."""
    from alphallama.engine import Engine, Generation
    from alphallama.spec.config import SpecConfig
    from alphallama.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(copying.metadata)
    resident = Engine(copying, _model(copying), tok, None, CTX)
    start = TOKENS[:4]
    prompt = start + list(resident.generate(start, 4, stop_ids=set())) + start
    resident.reset()
    plain = list(resident.generate(prompt, 6, stop_ids=set()))
    m = _model(copying, 3)
    m.store.admit_bytes_per_round = 1 << 30                     # admit at every chance
    engine = Engine(copying, m, tok, None, CTX)
    assert list(engine.generate(prompt, 6, stop_ids=set())) == plain
    engine.reset()
    g = Generation()
    assert list(engine.generate(prompt, 6, gen=g, spec=SpecConfig("ngram", 6, 2, gate=False), stop_ids=set())) == plain
    assert g.stats.draft_n_accepted > 0, g.stats
    assert m.store.stats.admissions >= 1


def test_the_plan_counts_a_hybrids_state(hybrid_moe):
    """model_sizes: K/V only for the attention layers, the recurrent layers' ring, state and
    gates in fp32, and no expert bytes for layers past n_layers."""
    from alphallama.gguf.arch import load_config
    from alphallama.kernels.deltanet.common import RING_ROWS, W_MAX
    from alphallama.offload.plan import KV_PAD_ROWS, model_sizes
    cfg = load_config(hybrid_moe)
    s = model_sizes(hybrid_moe, cfg, 128)
    kv = 2 * len(cfg.attn_layers) * cfg.n_kv_heads * (128 + KV_PAD_ROWS) * cfg.head_dim * 2
    rec = 4 * len(cfg.recurrent_layers) * (RING_ROWS * cfg.conv_dim + cfg.ssm_v_heads * cfg.ssm_head_dim ** 2
                                           + W_MAX * 2 * cfg.ssm_v_heads)
    assert s.kv == kv + rec
    m = _model(hybrid_moe)
    cache = m.new_cache(128)
    held = sum(x.numel() * x.element_size() for x in (cache.ring, cache.ssm, cache.ab))
    assert held == rec
    assert s.n_experts == cfg.n_layers * cfg.n_experts and len(s.layer_experts) == cfg.n_layers


def test_a_long_prompt_reads_the_store_once_a_chunk_and_teaches_the_policy(hybrid_moe):
    """A prompt past 64 rows takes the prefill path: each expert from its slot or the host tier
    once a chunk (gpu_prefill.moe_loop), logits within the runtime's tolerance of the resident
    model's (its fused grouped GEMMs sum in another order), and the prompt's routing is what
    the bank's policy learns before the first decode round."""
    prompt = torch.randint(0, TINY["vocab_size"], (70,), generator=torch.Generator().manual_seed(7))
    resident = _model(hybrid_moe)
    ref, _ = resident.forward(prompt, 0, resident.new_cache())
    m = _model(hybrid_moe, 3)
    got, _ = m.forward(prompt, 0, m.new_cache())
    torch.testing.assert_close(got, ref, atol=2e-3 * ref.abs().max().item(), rtol=0)
    score = m.store.policy.score
    assert score[:TINY["n_layers"]].sum() > 0 and m.store.stats.lookups == 0


def test_streams_through_the_store_get_their_tokens_alone(hybrid_moe):
    """-np 2 on the hybrid with a store of 3 slots, admissions mid-run: each stream's tokens are
    its tokens alone on the resident model; the shared passes fed the store (every stream's
    rows reached the policy)."""
    from alphallama.engine import Engine
    from alphallama.tokenizer import Tokenizer
    from streamutil import drive
    tok = Tokenizer.from_metadata(hybrid_moe.metadata)
    prompts, n_new = [[155, 140, 140, 9], [9, 148, 10]], 4
    alone_e = Engine(hybrid_moe, _model(hybrid_moe), tok, None, CTX)
    alone = []
    for p in prompts:
        alone_e.reset()
        alone.append(list(alone_e.generate(p, n_new, stop_ids=set())))
    m = _model(hybrid_moe, 3)
    m.store.policy.margin = 0.0
    m.store.admit_bytes_per_round = 1 << 30
    e = Engine(hybrid_moe, m, tok, None, CTX, slots=2)
    rounds: list = []
    got, _, runs = drive(e, prompts, n_new, stop_ids=set(), rounds=rounds)
    assert got == alone
    assert any(n > 1 for n, _ in rounds)                                  # shared passes ran
    m.store.before_round()
    rows = sum(sum(r.rows) for r in runs)
    assert m.store.stats.lookups >= rows * TINY["n_layers"] * MOE["n_experts_used"]
    assert m.store.stats.admissions >= 1

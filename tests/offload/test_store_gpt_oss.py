"""gpt-oss's experts (MXFP4, a bias per expert on gate, up and down, swiglu_oai) through the
expert store with the CPU workers on (the interpreter and the C workers): every MoE layer runs
the expert contract, and each layer's output (so the logits) is bit-identical whichever tier
served each expert: the bank, the host tier read by the GPU's kernels, the CPU workers from
the host tier, or from the GGUF file's mapping (the mapped tier's MXFP4 rows re-laid in C).

The model: tiny-gpt-oss at two layers, d_model 96 (not a power of two, as gpt-oss's 2880),
4 experts of width 64, its biases drawn larger than the writer's (std 0.5) so they matter."""
from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.synth_spec import SyntheticSpec, uniform_mix
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.kernels.activations.act_ids import ACT_IDS
from alphallama.offload.plan import make_plan
from alphallama.runtime import moe as runtime_moe
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides
from tests.offload.test_store import _teacher_forced

QUANT = uniform_mix(T.Q8_0) | {g: T.MXFP4 for g in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
TOKENS = [5, 9, 100, 7]
pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class _Loud(SyntheticSpec):
    """The preset's spec with larger biases (SyntheticSpec.init_override)."""

    def init_override(self, name: str) -> tuple[float, float] | None:
        return (0.0, 0.5) if name.endswith(".bias") else None


def _write(path, quant: dict) -> str:
    spec = PRESETS["tiny-gpt-oss"](n_layers=2, d_model=96, n_heads=2, n_kv_heads=1, head_dim=32, vocab_size=260,
                                   d_ff_expert=64, quant=quant, seed=3)
    write_synthetic(_Loud(**{x.name: getattr(spec, x.name) for x in fields(spec)}), path)
    return str(path)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> GGUFFile:
    return GGUFFile(_write(tmp_path_factory.mktemp("store_gpt_oss") / "gpt-oss.gguf", QUANT))


def _run(f: GGUFFile, slots: int, share: float = 1.0, host_bytes: int | None = None):
    """(model, logits of a 3-row prefill and a decode row, each MoE layer's output in order)."""
    m = GPUModel(f, 64, device="cpu", expert_slots=slots, cpu_tier=True, cpu_threads=1, host_bytes=host_bytes,
                 overrides=Overrides(attention_tiles=(16, 4)))
    assert m.cpu_tier is not None, "gpt-oss's experts are in the contract: the CPU workers start"
    m.store.admit_bytes_per_round = 0          # the start layout throughout
    m.cpu_link.set_share(share)
    outs = []

    def spy(*a, **k):
        outs.append(runtime_moe_q8(*a, **k).clone())
        return outs[-1]
    runtime_moe_q8, runtime_moe.moe_q8 = runtime_moe.moe_q8, spy
    try:
        logits = _teacher_forced(m, TOKENS)
    finally:
        runtime_moe.moe_q8 = runtime_moe_q8
    assert len(outs) == 2 * 2                  # 2 layers x (the prefill, the decode row): all on the contract
    return m, logits, outs


def test_every_tier_gives_the_bank_bits(gpt_oss):
    f = gpt_oss
    ref, want, want_moe = _run(f, 8)                                     # all 8 experts in the bank
    assert int(ref.cpu_link.seq.item()) == 0                            # nothing was posted
    assert all(int(d.act) == ACT_IDS["swiglu_oai"] for d in ref.cpu_experts._descs)
    assert all(d.gate_up.bias and d.down.bias for d in ref.cpu_experts._descs)   # the workers have the biases
    one_layer = ref.store.layer_bytes(0)
    # all in the host tier, every host pair the CPU's; then 3 slots, layer 1 in the mapped file
    # (always the CPU's), layer 0's host pairs half the CPU's, half read over "PCIe" by the kernels
    for slots, share, host_bytes in ((0, 1.0, None), (3, 0.5, one_layer)):
        m, got, got_moe = _run(f, slots, share, host_bytes)
        assert sorted(m.store.mapped) == ([1] if host_bytes else [])
        assert all(torch.equal(a, b) for a, b in zip(got_moe, want_moe)), (slots, share)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (slots, share)
        posts = int(m.cpu_link.seq.item())
        assert posts >= (4 if slots == 0 else 2) and int(m.cpu_link.mailbox.ctl[16]) == posts   # DONE
        m.cpu_experts.stop()
    ref.cpu_experts.stop()


def test_the_plan_counts_the_workers_for_gpt_oss(gpt_oss, tmp_path):
    """An offload plan of the gpt-oss file sizes CPU expert workers (its experts are the
    contract's); with IQ4_NL down experts (outside it) none, and it says why."""
    s = make_plan(gpt_oss.path, ctx=64, gpu_mem=1 << 40).sizes
    budget = s.dense + s.kv + s.workspace + s.experts // 2
    plan = make_plan(gpt_oss.path, ctx=64, gpu_mem=budget)
    assert plan.layout == "offload" and plan.cpu_threads >= 1
    other = _write(tmp_path / "iq4.gguf", QUANT | {"ffn_down_exps": T.IQ4_NL})
    plan = make_plan(other, ctx=64, gpu_mem=budget)
    assert plan.layout == "offload" and plan.cpu_threads == 0 and "IQ4_NL experts are outside" in plan.cpu_threads_why

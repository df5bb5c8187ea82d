"""Issue 32's last GPU quant types in whole models (as test_gpu_quant_types_model.py): synthetic
files in them load into the GPU runtime (the interpreter on CPU), `plan`'s support check names
the GPU for every tensor, the logits follow the reference transformer's and a verify round
equals its rows run alone (exact mode).

  IQ3_XXS   an IQ3_XXS-style mix: IQ3_XXS attention and ffn, IQ4_XS v, Q3_K down (llama)
  rest      IQ2_XXS / IQ2_XS / IQ2_S / IQ3_S / IQ1_S / IQ1_M / TQ1_0 / TQ2_0, one tensor each (llama)
  MXFP4     gpt-oss's expert type: MXFP4 routed experts (qwen3moe; gpt-oss itself: test_gpu_gpt_oss.py)
"""
from __future__ import annotations


import pytest
import torch
from gguf import GGMLQuantizationType as T


from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.offload.plan import make_plan  # noqa: E402
from alphallama.offload.support import gpu_problems, type_uses  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from gpucheck import follows_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MIXES = {
    "IQ3_XXS": ("tiny-llama", {g: T.IQ3_XXS for g in ("embd", "attn_q", "attn_k", "attn_output", "ffn_gate",
                                                     "ffn_up", "output")}
                | {"attn_v": T.IQ4_XS, "ffn_down": T.Q3_K}),
    "rest": ("tiny-llama", {"embd": T.TQ2_0, "attn_q": T.IQ2_XXS, "attn_k": T.IQ2_XS, "attn_v": T.IQ2_S,
                            "attn_output": T.IQ3_S, "ffn_gate": T.IQ1_S, "ffn_up": T.IQ1_M, "ffn_down": T.TQ1_0,
                            "output": T.IQ2_XXS}),
    "MXFP4": ("tiny-qwen3moe", {g: T.MXFP4 for g in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
              | {"embd": T.Q8_0, "output": T.Q8_0}),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_model_in_the_new_types_runs_on_the_gpu_path(tmp_path, mix):
    preset, quant = MIXES[mix]
    path = tmp_path / f"{mix}.gguf"
    write_synthetic(PRESETS[preset](n_layers=1, quant=quant, seed=3), path)
    f = GGUFFile(path)
    assert gpu_problems(f.tensors) == []
    uses = type_uses(f.tensors)
    assert all(uses[q.name].runs_on == "cpu+gpu" for q in set(quant.values()))
    plan = make_plan(str(path), gpu_mem=1 << 40, device="auto")
    assert plan.layout == "resident" and not plan.gpu_refused
    ref, gpu = load_model(f, 128), GPUModel(f, 128, device=DEV)
    toks = torch.randint(0, ref.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    follows_reference(ref, gpu, toks, 128, alone_from=3)


def test_new_expert_types_through_the_store(tmp_path):
    """Routed experts outside the expert contract (MXFP4 gate|up, which it has, beside IQ3_S
    down, which it has not: a codebook, whose table must stay on the device while its planes
    sit in the host tier) through the expert store: the CPU workers stay off, and every tier
    gives the resident model's bits."""
    path = tmp_path / "store.gguf"
    quant = {"ffn_gate_exps": T.MXFP4, "ffn_up_exps": T.MXFP4, "ffn_down_exps": T.IQ3_S}
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=1, quant=quant, seed=4), path)
    f = GGUFFile(path)
    toks = [5, 9, 100, 7]

    def logits(m):
        cache = m.new_cache(64)
        out = [m.forward(torch.tensor(toks[:3]), 0, cache)[0].clone()]
        return out + [m.forward(torch.tensor(toks[3:]), 3, cache)[0].clone()]

    ref = logits(GPUModel(f, 64, device=DEV))
    # a mix of the tiers (all in the host tier, slots 0, runs each expert as the mix's host
    # ones do: test_store.py takes both layouts)
    m = GPUModel(f, 64, device=DEV, expert_slots=3, cpu_tier=True)
    m.store.admit_bytes_per_round = 0
    assert m.cpu_link is None and m.store.slots == 3
    assert all(torch.equal(a, b) for a, b in zip(logits(m), ref))
    m.store.before_round()                                  # observes the last round's routing
    assert 0 < m.store.stats.hits < m.store.stats.lookups   # experts of both tiers were routed to

"""RoPE scaling on the GPU runtime (Llama 3.1's rope_freqs, YaRN, linear, phi3's longrope with
its fused projections) and the query temperature (mistral3, llama4).

The GPU runtime takes its cos/sin tables from the reference model's model/rope.py, which
tests/model/test_archs_vs_llamacpp.py proves against llama.cpp (~2e-6 relative on these
presets). So: the tables must be the reference's, bit for bit, with the scaling applied
(not the plain tables); and the runtime's logits must follow the scaled reference, not
the unscaled one (Triton kernels; the interpreter on CPU)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch


from alphallama.gguf.arch_variants import RopeScaling, gpu_departures
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.layers import rope_tables
from alphallama.model.loader import load_model
from alphallama.model.transformer import Transformer
from alphallama.runtime.gpu_model import GPUModel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 128
pytestmark = pytest.mark.usefixtures("one_thread")


def _models(tmp_path, preset: str):
    path = tmp_path / f"{preset}.gguf"
    write_synthetic(PRESETS[preset](n_layers=1, quant="Q8_0", seed=3), path)
    f = GGUFFile(path)
    return load_model(f, CTX), GPUModel(f, CTX, device=DEV)


@pytest.mark.parametrize("preset", ["tiny-llama31", "tiny-llama-yarn", "tiny-llama-linear"])
def test_tables_are_the_references(tmp_path, preset):
    ref, gpu = _models(tmp_path, preset)
    assert gpu_departures(ref.cfg) == []
    cos, sin = ref.ropes[0]                                                  # [CTX, rope_dim/2]
    assert torch.equal(gpu.ropes[0][0][:CTX].cpu(), cos) and torch.equal(gpu.ropes[0][1][:CTX].cpu(), sin)
    plain_cos, _ = rope_tables(CTX, ref.cfg.rope_dim, ref.cfg.rope_base)
    assert (cos - plain_cos).abs().max() > 1e-3, "the scaling was not applied"


def test_logits_follow_the_scaled_reference(tmp_path):
    """YaRN (frequency ramp and magnitude scale): the runtime's logits are within the GPU
    tests' tolerance of the scaled reference (int8 activations, fp16 K/V:
    test_gpu_model.py), and the unscaled reference is far outside it."""
    ref, gpu = _models(tmp_path, "tiny-llama-yarn")
    cfg = ref.cfg
    plain = Transformer(replace(cfg, variant=replace(cfg.variant, rope=RopeScaling(), rope_factors=())),
                        ref.w, ref.max_len)
    toks = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    lr, _ = ref.forward(toks, 0, ref.new_cache(CTX))                         # [12, V]
    lp, _ = plain.forward(toks, 0, plain.new_cache(CTX))
    lg, _ = gpu.forward(toks, 0, gpu.new_cache(CTX))
    atol = 4e-2 * lr.abs().max().item()
    torch.testing.assert_close(lg.cpu(), lr, atol=atol, rtol=0)
    assert (lp - lr).abs().max() > 3 * atol          # measured: 0.25 of the max logit, against <= 0.02


def test_query_temperature_follows_the_reference(tmp_path):
    """mistral3 / llama4: q scaled by 1 + s log(floor(p / floor) + 1) (the tiny preset: floor
    16, s 0.5), in a prefill chunk (positions 0..78: steps at 16, 32, 48, 64) and in a decode
    round after it (79..81: the step at 80)."""
    ref, gpu = _models(tmp_path, "tiny-mistral3")
    cfg = ref.cfg
    assert gpu_departures(cfg) == [] and gpu.q_temp == (0.5, 16)
    plain = Transformer(replace(cfg, variant=replace(cfg.variant, attn_temp_scale=0.0)), ref.w, ref.max_len)
    toks = torch.randint(0, cfg.vocab_size, (82,), generator=torch.Generator().manual_seed(1))
    lr, _ = ref.forward(toks, 0, ref.new_cache(CTX))                          # [82, V]
    lp, _ = plain.forward(toks, 0, plain.new_cache(CTX))
    cache = gpu.new_cache(CTX)
    lg = torch.cat([gpu.forward(toks[:79], 0, cache)[0].cpu(), gpu.forward(toks[79:], 79, cache)[0].cpu()])
    for rows in (slice(0, 79), slice(79, 82)):                                # the prefill chunk; the round
        atol = 4e-2 * lr[rows].abs().max().item()
        torch.testing.assert_close(lg[rows], lr[rows], atol=atol, rtol=0)
        assert (lp[rows] - lr[rows]).abs().max() > 3 * atol   # measured: ~0.48 of the max logit, against <= 0.02


def test_phi3_longrope_and_fused_projections(tmp_path):
    """phi3: longrope's short factors within the original context (64 in the tiny preset)
    and its long ones past it, the reference's tables at both; q/k/v and gate/up from their
    fused matrices (attn_qkv; ffn_up = [gate; up]) through the same Linears."""
    path = tmp_path / "phi3.gguf"
    write_synthetic(PRESETS["tiny-phi3"](n_layers=1, quant="Q8_0", seed=3), path)
    f = GGUFFile(path)
    for ctx in (32, CTX):
        ref, gpu = load_model(f, ctx), GPUModel(f, ctx, device=DEV)
        assert gpu_departures(ref.cfg) == []
        assert torch.equal(gpu.ropes[0][0][:ctx].cpu(), ref.ropes[0][0]) and torch.equal(gpu.ropes[0][1][:ctx].cpu(), ref.ropes[0][1])
    toks = torch.randint(0, ref.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    lr, _ = ref.forward(toks, 0, ref.new_cache(CTX))
    lg, _ = gpu.forward(toks, 0, gpu.new_cache(CTX))
    torch.testing.assert_close(lg.cpu(), lr, atol=4e-2 * lr.abs().max().item(), rtol=0)   # measured <= 0.017

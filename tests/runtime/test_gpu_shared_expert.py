"""The shared expert on the GPU runtime (qwen2moe; the hybrids' MoE layers have the same
one): a dense SwiGLU beside the routed experts, scaled per row by sigmoid(h . g).
Triton kernels; the interpreter on CPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch


from gpucheck import TOL, follows_reference

from alphallama.gguf.arch_variants import gpu_departures
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.model.transformer import Transformer
from alphallama.runtime.gpu_model import GPUModel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 128
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("shexp") / "qwen2moe.gguf"
    write_synthetic(PRESETS["tiny-qwen2moe"](n_layers=1, quant="Q4_K", seed=3), path)
    f = GGUFFile(path)
    ref, gpu = load_model(f, CTX), GPUModel(f, CTX, device=DEV)
    assert gpu_departures(ref.cfg) == [] and gpu.layers[0].shared is not None
    return ref, gpu


def test_decode_follows_the_reference_and_rows_keep_their_bits(models):
    """Logits within the GPU tests' tolerance of the reference (int8 activations, fp16
    K/V: test_gpu_model.py), the reference without its shared expert far outside it; a
    round of 3 rows equals the rows run one at a time, bit for bit."""
    ref, gpu = models
    toks = torch.randint(0, ref.cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    lr = follows_reference(ref, gpu, toks, CTX, alone_from=3)                  # [6, V]
    bare = Transformer(replace(ref.cfg, variant=replace(ref.cfg.variant, shared_expert_ff=0)), ref.w, ref.max_len)
    ln, _ = bare.forward(toks, 0, bare.new_cache(CTX))
    assert (ln - lr).abs().max() > 3 * TOL * lr.abs().max()   # measured: 0.56 of the max logit, against 0.013


def test_prefill_chunk_follows_the_reference(models):
    """A prompt of more than the decode rounds' 64 rows goes through the prefill path
    (the scratch's GEMMs; the shared expert's units planned after the routed experts)."""
    ref, gpu = models
    toks = torch.randint(0, ref.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    lr, _ = ref.forward(toks, 0, ref.new_cache(CTX))
    lg, _ = gpu.forward(toks, 0, gpu.new_cache(CTX))
    torch.testing.assert_close(lg.cpu(), lr, atol=4e-2 * lr.abs().max().item(), rtol=0)   # measured 3e-4

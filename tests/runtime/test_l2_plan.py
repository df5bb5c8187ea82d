"""Which kernel asks L2 for which weight (runtime/l2_plan.py): the plans cover exactly
the bytes the module's table names, and on a GPU the prefetching model gives the same
logits bit for bit as the one without (a prefetch is a hint)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.kernels.l2 import ALIGN  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from alphallama.runtime.l2_plan import layer_prefetch  # noqa: E402


def _model(tmp_path, preset: str, device: str = "cpu", **kw) -> GPUModel:
    path = tmp_path / f"{preset}.gguf"
    write_synthetic(PRESETS[preset](n_layers=2, quant="Q4_K", seed=11), path)
    return GPUModel(GGUFFile(path), 64, device=device, graphs=False, **kw)


def _bytes(planes: list, lo: float, hi: float) -> int:
    """What a plan over [lo, hi) of these planes should hold (both ends rounded to ALIGN)."""
    tot = 0
    for p in planes:
        n = p.numel() * p.element_size()
        tot += int(n * hi) // ALIGN * ALIGN - int(n * lo) // ALIGN * ALIGN
    return tot


def _planes(linear) -> list:
    return [p for w in linear.weights for p in w.planes.values()]


def test_dense_layer_plans(tmp_path):
    gpu = _model(tmp_path, "tiny-qwen3")
    L0, L1 = gpu.layers
    gu, dn = L0.gate_up, L0.down
    head, tail = gu.nbytes // 3, gu.nbytes                       # the tail runs past the weight's end
    pf = layer_prefetch(L0, L1, head, tail)
    assert pf.qkv.nbytes == _bytes(_planes(L0.qkv), 0, 1)
    assert pf.o.nbytes == _bytes(_planes(L0.o), 0, 1)
    assert pf.attn.nbytes == _bytes(_planes(gu), 0, head / gu.nbytes)
    assert pf.ffn.nbytes == _bytes(_planes(gu), head / gu.nbytes, 1)
    assert pf.silu.nbytes == _bytes(_planes(dn), 0, min(1, head / dn.nbytes))
    # where the budget is spent before a weight: no plan
    assert layer_prefetch(L0, L1, gu.nbytes, 1 << 20).ffn is None
    # the CPU model never prefetches
    assert all(p.qkv is None and p.attn is None for p in gpu.prefetch)


def test_moe_layer_plans(tmp_path):
    gpu = _model(tmp_path, "tiny-qwen3moe", moe_gemv="i8")
    L0, L1 = gpu.layers
    pf = layer_prefetch(L0, L1, 1 << 20, 1 << 20)
    router = list(L0.moe.router.planes.values())
    assert pf.o.nbytes == _bytes(_planes(L0.o), 0, 1) + _bytes(router, 0, 1)
    assert pf.ffn.nbytes == _bytes(_planes(L1.qkv), 0, 1)          # the next layer's qkv, ahead of its norm
    assert pf.attn is None and pf.silu is None                    # the experts: asked for once routed
    assert layer_prefetch(L1, None, 1 << 20, 1 << 20).ffn is None
    assert L0.moe.l2_experts is None                              # the CPU model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bulk prefetch runs on a GPU only")
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3moe"])
def test_prefetching_model_gives_the_same_bits(tmp_path, preset):
    toks = torch.randint(0, 200, (4,), generator=torch.Generator().manual_seed(5))
    logits = {}
    for on in (False, True):
        gpu = _model(tmp_path, preset, device="cuda", l2_prefetch=on)
        assert any(p.qkv is not None for p in gpu.prefetch) == on
        if preset == "tiny-qwen3moe":
            assert (gpu.layers[0].moe.l2_experts is not None) == on
        logits[on] = gpu.forward(toks, 0, gpu.new_cache(64))[0].clone()
    assert torch.equal(logits[True], logits[False])

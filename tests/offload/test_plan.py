"""The automatic plan: sizes from the header equal what the GPU runtime allocates, for
every supported architecture; the layout at several budgets; a clear error when even
the dense part does not fit; `alphallama plan`; flags and ALPHA_AUTO."""
from __future__ import annotations

import os

import argparse
import math

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from alphallama.cli import main
from alphallama.gguf.arch import ARCHS
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.offload.apply import engine_kwargs, parse_bytes, plan_from_args
from alphallama.offload.plan import PlanError, make_plan
from alphallama.runtime.gpu_model import GPUModel

ARCH_PRESETS = {"llama": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3", "qwen3moe": "tiny-qwen3moe",
                "qwen2moe": "tiny-qwen2moe", "mistral3": "tiny-mistral3",
                "phi3": "tiny-phi3", "gemma3": "tiny-gemma3", "gpt-oss": "tiny-gpt-oss"}
CTX = 256


def test_every_architecture_the_gpu_runs_has_a_preset_here(tmp_path):
    """The plan is the GPU runtime's: an architecture it refuses (a hybrid, or a variant
    with pieces the GPU path lacks) has no plan to size; every other one is tested here."""
    from alphallama.gguf.arch import load_config
    from alphallama.gguf.arch_qwen35 import HybridConfig
    from alphallama.gguf.arch_variants import gpu_departures
    runs = set()
    for arch in ARCHS:
        path = tmp_path / f"{arch}.gguf"
        write_synthetic(PRESETS[f"tiny-{arch}"](n_layers=2), path)
        cfg = load_config(GGUFFile(str(path)))
        if not isinstance(cfg, HybridConfig) and not gpu_departures(cfg):
            runs.add(arch)
    assert set(ARCH_PRESETS) == runs


@pytest.fixture(scope="module", params=sorted(ARCH_PRESETS))
def model(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / f"{request.param}.gguf"
    write_synthetic(PRESETS[ARCH_PRESETS[request.param]](n_layers=2, quant="Q4_K_M"), path)
    return str(path)


def _held_bytes(m: GPUModel) -> tuple[int, int]:
    """(dense, experts) bytes the runtime really holds, counted from its objects."""
    qw = lambda w: sum(p.numel() * p.element_size() for p in w.planes.values())   # noqa: E731
    embd = m.embd.numel() if isinstance(m.embd, torch.Tensor) else 0 if m.embd in m.output.weights else qw(m.embd)
    dense = embd + sum(qw(w) for w in m.output.weights) + m.output_norm.numel() * 4
    experts = 0
    for L in m.layers:
        vecs = [L.attn_norm, L.ffn_norm, L.qkv_bias, L.q_norm, L.k_norm, L.post_attn_norm, L.post_ffn_norm,
                L.sinks, L.o_bias]
        if L.moe is not None:                       # gpt-oss: the router's and the experts' biases
            vecs += [L.moe.router_bias, L.moe.gate_up_bias, L.moe.down_bias]
        dense += sum(v.numel() * 4 for v in vecs if v is not None)
        dense += sum(qw(w) for lin in (L.qkv, L.o, L.gate_up, L.down) if lin is not None for w in lin.weights)
        if L.shared is not None:
            dense += sum(qw(w) for lin in (L.shared.gate_up, L.shared.down) for w in lin.weights) + qw(L.shared.gate)
        if L.moe is not None:
            dense += qw(L.moe.router)
            experts += qw(L.moe.gate_up) + qw(L.moe.down)
    return dense, experts


def test_sizes_equal_what_the_runtime_allocates(model):
    plan = make_plan(model, ctx=CTX, gpu_mem=1 << 40)
    m = GPUModel(GGUFFile(model), CTX, device="cpu", graphs=False)
    assert (plan.sizes.dense, plan.sizes.experts) == _held_bytes(m)
    cache = m.new_cache(CTX)
    assert plan.sizes.kv == cache.k.numel() * cache.k.element_size() * 2
    assert plan.layout == "resident" and plan.ctx == CTX


def test_layouts_at_several_budgets(model):
    s = make_plan(model, ctx=CTX, gpu_mem=1 << 40).sizes
    fixed = s.dense + s.kv + s.workspace
    moe = s.n_experts > 0
    assert make_plan(model, ctx=CTX, gpu_mem=s.total).layout == "resident"
    for frac in (0.75, 0.5, 0.25) if moe else ():   # a dense model's weights are all in `fixed`
        budget = fixed + int(frac * s.experts)
        p = make_plan(model, ctx=CTX, gpu_mem=budget)
        assert p.layout == "offload"
        assert p.slots == (budget - fixed) // s.expert_slot
        assert p.slots * s.expert_slot <= budget - fixed
        assert "offload" in p.describe() and f"{p.slots} of {s.n_experts}" in p.describe()
        # CPU expert workers (this host has a C compiler): sized by the probe, never every cpu
        cpus = len(os.sched_getaffinity(0))
        assert 1 <= p.cpu_threads <= max(cpus - 1, 1)
        assert f"+ {p.cpu_threads} CPU expert workers" in p.describe() and "computed by CPU workers" in p.describe()
    with pytest.raises(PlanError, match="too small for the dense part" if moe else "too small for the model"):
        make_plan(model, ctx=CTX, gpu_mem=fixed - 1)


def test_longer_context_needs_more(model):
    a = make_plan(model, ctx=128, gpu_mem=1 << 40).sizes.kv
    b = make_plan(model, ctx=256, gpu_mem=1 << 40).sizes.kv
    cfg_rows = lambda ctx: ctx + 64   # noqa: E731  (the padded bucket past the context)
    assert b * cfg_rows(128) == a * cfg_rows(256)


def test_plan_command(model, capsys):
    s = make_plan(model, ctx=CTX, gpu_mem=1 << 40).sizes
    budget = s.dense + s.kv + s.workspace + s.experts // 2
    rc = main(["plan", "-m", model, "-c", str(CTX), "--gpu-mem", str(budget)])
    out, err = capsys.readouterr()
    if s.n_experts:
        assert rc == 0 and "layout     offload" in out and "kv cache" in out and "dense" in out
    else:   # a dense model gets budget == all it needs
        assert rc == 0 and "layout     all resident" in out
    assert main(["plan", "-m", model, "-c", str(CTX), "--gpu-mem", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alphallama plan: error:") and "too small" in err and "Traceback" not in err


def test_budget_parsing_and_flags(model, monkeypatch):
    assert parse_bytes("24G") == 24 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("1000") == 1000
    assert parse_bytes("1.5GiB") == 3 << 29
    for bad in ("abc", "-5", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    args = argparse.Namespace(ctx_size=None, device="auto", gpu_mem=None)
    plan = plan_from_args(args, model)
    assert plan is not None and engine_kwargs(args, plan)["ctx_size"] == plan.ctx
    assert engine_kwargs(argparse.Namespace(ctx_size=100, device="cpu"), plan)["ctx_size"] == 100   # flags win
    monkeypatch.setenv("ALPHA_AUTO", "0")
    assert plan_from_args(args, model) is None
    assert engine_kwargs(args, None) == {"ctx_size": None, "device": "auto", "fast": False}


def test_fast_modes_tensor_core_copy_is_planned(tmp_path):
    """--fast on a resident Q4_K model: the plan counts the second copy of the dense Q4_K
    codes (half a byte a weight: the qs plane in the tensor cores' order) and asks the
    engine for it only where it fits beside everything else."""
    path = tmp_path / "q4k.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=2, quant="Q4_K"), path)
    f = GGUFFile(str(path))
    tied = "output.weight" not in f.tensors                  # a tied embedding is the head's Linear
    want = sum(t.shape[0] * t.shape[1] // 2 for n, t in f.tensors.items()
               if t.qtype == GGMLQuantizationType.Q4_K and (n != "token_embd.weight" or tied) and len(t.shape) == 2)
    s = make_plan(str(path), ctx=CTX, gpu_mem=1 << 40).sizes
    assert s.fast_extra == want > 0
    fast = argparse.Namespace(ctx_size=None, device="auto", fast=True)
    roomy = make_plan(str(path), ctx=CTX, gpu_mem=s.total + s.fast_extra)
    tight = make_plan(str(path), ctx=CTX, gpu_mem=s.total + s.fast_extra - 1)
    assert roomy.layout == tight.layout == "resident"
    assert engine_kwargs(fast, roomy)["fast"] is True and engine_kwargs(fast, tight)["fast"] is False
    assert engine_kwargs(argparse.Namespace(ctx_size=None, device="auto"), roomy)["fast"] is False   # no --fast
    assert "fast       --fast adds" in roomy.describe() and "does not fit" in tight.describe()


def test_offload_plan_sets_the_slots(tmp_path):
    path = tmp_path / "moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=2, quant="Q4_K_M"), path)
    s = make_plan(str(path), ctx=CTX, gpu_mem=1 << 40).sizes
    plan = make_plan(str(path), ctx=CTX, gpu_mem=s.dense + s.kv + s.workspace + s.experts // 4)
    kw = engine_kwargs(argparse.Namespace(ctx_size=None, device="auto"), plan)
    assert kw["expert_slots"] == plan.slots == math.floor(s.experts // 4 / s.expert_slot)
    assert kw["cpu_threads"] == plan.cpu_threads >= 1        # the workers the plan sized
    from alphallama.offload.apply import summary
    assert f"computed by {plan.cpu_threads} CPU workers" in summary(plan)
    if not torch.cuda.is_available():   # run/serve on a CPU box: the budget does not apply
        cpu_args = argparse.Namespace(ctx_size=CTX, device="auto", gpu_mem=1 << 20)
        assert plan_from_args(cpu_args, str(path)).layout == "cpu"

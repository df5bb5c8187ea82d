"""Which runtime computes each tensor type: the verdicts come from the runtimes' own
registries, `plan` falls back to the CPU for a file the GPU would refuse (and plans
nothing it would refuse), `inspect` lists the types with their runtimes."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from alphallama.cli import main
from alphallama.gguf.reader import GGUFFile, TensorInfo
from alphallama.gguf.writer import SyntheticSpec, uniform_mix, write_synthetic
from alphallama.kernels.formats.qweight import format_of
from alphallama.model.loader import load_model
from alphallama.offload.apply import engine_kwargs
from alphallama.offload.plan import PlanError, make_plan
from alphallama.offload import support
from alphallama.offload.support import cpu_problems, cpu_workers_refusal, gpu_problems, type_uses


def _spec(quant, tied=False) -> SyntheticSpec:
    return SyntheticSpec(arch="llama", name="types", n_layers=2, d_model=256, n_heads=2, n_kv_heads=1,
                         head_dim=128, d_ff=512, vocab_size=300, ctx_len=128, quant=quant,
                         tied_embeddings=tied, seed=3)


# a type the CPU dequantizes and the GPU runtime has no format for. Every type the CPU runs
# has a GPU format since issue 32's last types: the GPU's lack of one is simulated, support's
# registry look-up refusing this type as format_of refuses a type it does not know
CPU_ONLY = T.IQ2_XXS


def _format_without_cpu_only(qtype):
    if T(qtype) == CPU_ONLY:
        raise ValueError(f"no GPU kernel for {CPU_ONLY.name} (simulated)")
    return format_of(qtype)


@pytest.fixture(scope="module", autouse=True)
def _gpu_lacks_cpu_only():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(support, "format_of", _format_without_cpu_only)
        yield


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("types") / "mixed.gguf"
    write_synthetic(_spec(uniform_mix(T.Q4_K) | {"ffn_down": CPU_ONLY, "embd": CPU_ONLY}), path)
    return str(path)


def test_type_verdicts(mixed):
    f = GGUFFile(mixed)
    uses = type_uses(f.tensors)
    assert sum(u.count for u in uses.values()) == len(f.tensors)
    assert sum(u.nbytes for u in uses.values()) == sum(t.nbytes for t in f.tensors.values())
    assert uses["Q4_K"].runs_on == "cpu+gpu" and uses["F32"].runs_on == "cpu+gpu"
    u = uses[CPU_ONLY.name]
    assert u.runs_on == "cpu only" and u.count == 3        # two ffn_down and the embedding
    assert "ffn_down" in u.gpu and CPU_ONLY.name in u.gpu    # names the refused tensor
    assert gpu_problems(f.tensors) == [u.gpu] and cpu_problems(f.tensors) == []


def test_untied_embedding_is_rows_tied_is_a_weight(tmp_path):
    """With an output head of its own the embedding's rows are dequantized (any CPU type);
    as the head (tied), it is a GPU weight."""
    for tied in (False, True):
        path = tmp_path / f"tied{tied}.gguf"
        write_synthetic(_spec(uniform_mix(T.Q4_K) | {"embd": CPU_ONLY}, tied=tied), path)
        u = type_uses(GGUFFile(str(path)).tensors)[CPU_ONLY.name]
        assert u.runs_on == ("cpu only" if tied else "cpu+gpu")


def test_plan_falls_back_to_cpu_and_cuda_refuses(mixed):
    plan = make_plan(mixed, gpu_mem=1 << 40, device="auto")
    assert plan.layout == "cpu" and plan.device == "cpu" and plan.gpu_refused
    text = plan.describe()
    assert "the GPU runtime cannot run this file" in text and f"{CPU_ONLY.name}" in text and "cpu only" in text
    d = plan.to_dict()
    assert d["types"][CPU_ONLY.name]["runs_on"] == "cpu only"
    json.dumps(d)
    args = argparse.Namespace(ctx_size=None, device="auto", fast=False)
    assert engine_kwargs(args, plan)["device"] == "cpu"
    with pytest.raises(PlanError, match="--device cuda, but the GPU runtime cannot run"):
        make_plan(mixed, gpu_mem=1 << 40, device="cuda")


def test_plan_of_a_gpu_file_is_unchanged(tmp_path):
    path = tmp_path / "q4k.gguf"
    write_synthetic(_spec(uniform_mix(T.Q4_K)), path)
    plan = make_plan(str(path), gpu_mem=1 << 40, device="auto")
    assert plan.layout == "resident" and not plan.gpu_refused
    assert {u.runs_on for u in plan.types.values()} == {"cpu+gpu"}


def test_the_cpu_runtime_really_runs_the_fallback(mixed):
    m = load_model(GGUFFile(mixed), max_len=16)
    logits, _ = m.forward(torch.tensor([1, 2, 3]), 0, m.new_cache())
    assert logits.shape == (3, 300) and torch.isfinite(logits).all()


def _fake(name, qtype, shape) -> TensorInfo:
    return TensorInfo(name, qtype, shape, np.zeros(1, np.uint8), 0)


def test_neither_runtime_and_expert_type_mismatch():
    tensors = {"blk.0.attn_q.weight": _fake("blk.0.attn_q.weight", T.Q8_K, (256, 256))}
    assert "Q8_K" in cpu_problems(tensors)[0] and "Q8_K" in gpu_problems(tensors)[0]
    tensors = {"blk.3.ffn_gate_exps.weight": _fake("g", T.Q4_K, (4, 64, 256)),
               "blk.3.ffn_up_exps.weight": _fake("u", T.Q6_K, (4, 64, 256))}
    assert any("blk.3." in p and "differ in type" in p for p in gpu_problems(tensors))


def test_cpu_workers_verdict():
    """The expert store's CPU workers take gpt-oss's experts (MXFP4, swiglu_oai: the expert
    contract's), not a codebook type, another activation or rows of partial 32-value blocks."""
    def experts(down=T.MXFP4, D=2880, F=2880):   # gate, up [E, F, D], down [E, D, F]
        return {f"blk.0.ffn_{n}_exps.weight": _fake(n, down if n == "down" else T.MXFP4,
                                                     (32, D, F) if n == "down" else (32, F, D))
                for n in ("gate", "up", "down")}
    assert cpu_workers_refusal(experts(), "swiglu_oai") is None and cpu_workers_refusal(experts(T.Q6_K), "silu") is None
    assert "IQ3_S experts are outside" in cpu_workers_refusal(experts(T.IQ3_S), "swiglu_oai")
    assert "gelu activation" in cpu_workers_refusal(experts(), "gelu")
    assert "32-value blocks" in cpu_workers_refusal(experts(F=2888), "silu")


def test_plan_and_inspect_commands(mixed, capsys):
    assert main(["plan", "-m", mixed, "--gpu-mem", "64G"]) == 0
    out = capsys.readouterr().out
    assert "cpu only" in out and "layout     cpu (reference runtime): the GPU runtime" in out
    assert main(["plan", "-m", mixed, "--gpu-mem", "64G", "--device", "cuda"]) == 2
    assert "cannot run" in capsys.readouterr().err
    assert main(["inspect", "-m", mixed]) == 0
    out = capsys.readouterr().out
    assert f"type {CPU_ONLY.name}" in out and "cpu only" in out
    assert main(["inspect", "-m", mixed, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["types"]["Q4_K"]["runs_on"] == "cpu+gpu"

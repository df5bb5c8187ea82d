"""The architecture variants: metadata -> Variant, the tensors they add, the synthetic
presets' round trip, the loader's fallback for types our dequantizers lack, and
`inspect` on a file whose architecture we do not run."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from alphallama.gguf.arch import expected_tensors, load_config
from alphallama.gguf.arch_variants import Meta, gpu_departures, read_rope, swa_pattern
from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.gguf.writer import PRESETS, model_config, write_synthetic
from alphallama.model.loader import load_model

NEW = ("tiny-llama31", "tiny-llama-yarn", "tiny-llama-linear", "tiny-gemma3", "tiny-gpt-oss", "tiny-phi3",
       "tiny-mistral3", "tiny-qwen2moe")

ON_GPU = ("tiny-llama31", "tiny-llama-yarn", "tiny-llama-linear",   # rope scaling: the reference's tables
          "tiny-phi3",                                                # longrope, fused projections
          "tiny-mistral3",                                            # the query temperature (round.query_temperature)
          "tiny-qwen2moe",                                            # the shared expert (runtime/shared_expert.py)
          "tiny-gemma3",    # windows, own rope base, post norms, GeGLU, scales, softcap (test_gpu_gemma3.py)
          "tiny-gpt-oss")   # sinks, biases, swiglu_oai, its gating (test_gpu_gpt_oss.py)


def _meta(**keys) -> Meta:
    return Meta({f"x.{k}": v for k, v in keys.items()}, "x", "<test>", 6)


@pytest.mark.parametrize("preset", NEW)
def test_presets_round_trip(tmp_path, preset):
    """The reader derives from the written file exactly the config the spec describes,
    every expected tensor is in the file, and the GPU path names what it lacks."""
    spec = PRESETS[preset]()
    write_synthetic(spec, tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    cfg = load_config(f)
    assert cfg == model_config(spec, spec.vocab_size)
    assert set(expected_tensors(cfg)) == set(f.tensors)
    assert bool(gpu_departures(cfg)) == (preset not in ON_GPU), preset


def test_base_presets_have_no_departures():
    for preset in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3moe"):
        spec = PRESETS[preset]()
        assert gpu_departures(model_config(spec, spec.vocab_size)) == [], preset


def test_swa_pattern_period_and_array():
    # llama.cpp's set_swa_pattern: layer i slides unless i % n == n - 1; 0: all slide
    assert swa_pattern(_meta(), 6) == (True,) * 5 + (False,)
    assert swa_pattern(_meta(), 2) == (True, False) * 3
    assert swa_pattern(_meta(**{"attention.sliding_window_pattern": 3}), 6) == (True, True, False) * 2
    flags = [True, False, False, True, True, False]
    assert swa_pattern(_meta(**{"attention.sliding_window_pattern": flags}), 6) == tuple(flags)
    with pytest.raises(GGUFError, match="one flag per layer"):
        swa_pattern(_meta(**{"attention.sliding_window_pattern": [True]}), 6)


def test_rope_scaling_read_as_llama_cpp_does():
    assert read_rope(_meta())[0].kind == "none"                        # missing: linear x1 = none
    r, _ = read_rope(_meta(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 100}))
    assert (r.kind, r.factor, r.orig_ctx) == ("yarn", 4.0, 100)       # original context defaults to the training one
    assert read_rope(_meta(**{"rope.scale_linear": 2.0}))[0].kind == "linear"   # the old key
    with pytest.raises(GGUFError, match="rope scaling 'ntk' is not supported"):
        read_rope(_meta(**{"rope.scaling.type": "ntk"}))
    with pytest.raises(GGUFError, match="longrope scaling needs"):
        read_rope(_meta(**{"rope.scaling.type": "longrope"}))


def test_mxfp4_experts_load_through_the_gguf_fallback(tmp_path):
    """gpt-oss ships MXFP4 experts; where our dequantizers lack a type the reference model
    takes the gguf package's, value for value."""
    spec = PRESETS["tiny-gpt-oss"](quant={g: T.MXFP4 for g in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")})
    write_synthetic(spec, tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    t = f.tensors["blk.1.ffn_up_exps.weight"]
    assert t.qtype == T.MXFP4
    model = load_model(f, 64)
    want = gguf_dequantize(np.asarray(t.data).view(np.uint8), T.MXFP4).reshape(t.shape)
    assert torch.equal(model.w["blk.1.ffn_up_exps.weight"], torch.from_numpy(want.astype(np.float32)))
    logits, _ = model.forward(torch.arange(5, 21), 0, model.new_cache())
    assert torch.isfinite(logits).all() and 0.2 < float(logits.std()) < 20


def test_inspect_shows_an_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = subprocess.run([sys.executable, "-m", "alphallama.cli", "inspect", "-m", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "architecture mamba: unsupported: " in r.stdout and "not supported" in r.stdout
    assert "mamba.block_count" in r.stdout and "token_embd.weight" in r.stdout
    r = subprocess.run([sys.executable, "-m", "alphallama.cli", "inspect", "-m", str(path), "--json"],
                       capture_output=True, text=True, timeout=120)
    d = json.loads(r.stdout)
    assert d["config"] is None and d["hyperparameters"]["mamba.embedding_length"] == 64

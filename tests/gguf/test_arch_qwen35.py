"""The hybrids in the arch table: the config the reader derives from a synthetic file is the
writer's, the layer kinds follow full_attention_interval, the tensor list is llama.cpp's,
and inconsistent recurrent metadata is refused with a GGUFError naming it."""
from __future__ import annotations

import pytest

from alphallama.gguf.arch import config_from_metadata, expected_tensors, load_config
from alphallama.gguf.arch_qwen35 import HybridConfig
from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.gguf.writer import PRESETS, model_config, plan_tensors, write_synthetic


@pytest.mark.parametrize("name,mtp", [("tiny-qwen3next", "moe"), ("tiny-qwen35", "dense"), ("tiny-qwen35moe", None)])
def test_file_reads_back_the_writers_config(name, mtp, tmp_path):
    spec = PRESETS[name](seed=2, mtp=mtp)
    path = tmp_path / "m.gguf"
    write_synthetic(spec, path)
    f = GGUFFile(str(path))
    cfg = load_config(f)
    assert isinstance(cfg, HybridConfig) and cfg == model_config(spec, cfg.vocab_size)
    assert cfg.recurrent == (True, True, True, False) and cfg.n_nextn == (1 if mtp else 0)
    assert cfg.rope_dim == 16 and cfg.norm_topk_prob
    names = set(expected_tensors(cfg))
    assert "blk.3.attn_q.weight" in names and "blk.0.ssm_a" in names and "blk.3.ssm_a" not in names
    assert ("blk.0.ssm_ba.weight" in names) == (name == "tiny-qwen3next")
    assert ("blk.0.ffn_gate_shexp.weight" in names) == cfg.is_moe
    assert tuple(f.tensors["blk.3.attn_q.weight"].shape) == (2 * cfg.q_dim, cfg.d_model)   # query + gate


def test_the_35b_a3b_like_preset_plans_without_writing():
    spec = PRESETS["qwen36-35b-a3b"]()
    plan = plan_tensors(spec, spec.vocab_size)
    cfg = model_config(spec, spec.vocab_size)
    assert cfg.attn_layers == list(range(3, 40, 4)) and len(cfg.recurrent_layers) == 30
    assert any(t.name == "blk.40.nextn.eh_proj.weight" for t in plan)
    gib = sum(t.nbytes for t in plan) / 2**30
    assert 15 < gib < 25, gib      # Qwen3.6-35B-A3B at Q4_K_M is ~20 GiB


def _md(**over):
    a = "qwen35"
    md = {"general.architecture": a, f"{a}.block_count": 4, f"{a}.embedding_length": 256,
          f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2, f"{a}.attention.key_length": 64,
          f"{a}.feed_forward_length": 512, f"{a}.rope.dimension_count": 16, f"{a}.rope.dimension_sections": [3, 3, 2, 0],
          f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.state_size": 32, f"{a}.ssm.group_count": 2,
          f"{a}.ssm.time_step_rank": 4, f"{a}.ssm.inner_size": 128, "tokenizer.ggml.tokens": ["a"] * 16}
    md.update({f"{a}.{k}": v for k, v in over.items()})
    return {k: v for k, v in md.items() if v is not None}


def test_metadata_checks():
    cfg = config_from_metadata(_md(**{"attention.recurrent_layers": [True, False, True, False]}))
    assert cfg.recurrent == (True, False, True, False)
    for over, msg in [({"ssm.inner_size": 100}, "inconsistent recurrent shape"),
                      ({"ssm.time_step_rank": 3, "ssm.inner_size": 96}, "inconsistent recurrent shape"),
                      ({"ssm.conv_kernel": None}, "ssm.conv_kernel' is missing"),
                      ({"rope.dimension_sections": None}, "rope.dimension_sections is missing"),
                      ({"rope.dimension_sections": [9, 9, 9, 0]}, "cover more than 8 pairs"),
                      ({"attention.recurrent_layers": [True]}, "must be 4 booleans"),
                      ({"feed_forward_length": None}, "needs feed_forward_length")]:
        with pytest.raises(GGUFError, match=msg):
            config_from_metadata(_md(**over))

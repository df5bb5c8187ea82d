"""Finding and checking a model's MTP head: in-file (nextn_predict_layers), a sidecar
next to the model or given explicitly, and a clear error for each wrong head."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from alphallama.gguf.arch import find_mtp_head, load_config, sidecar_path
from alphallama.gguf.reader import GGUFError, GGUFFile
from alphallama.gguf.writer import PRESETS, write_mtp_sidecar, write_synthetic


def _model(tmp_path, name="m", **kw):
    path = tmp_path / f"{name}.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, **kw), path)
    f = GGUFFile(path)
    return f, load_config(f)


def test_in_file_head(tmp_path):
    f, cfg = _model(tmp_path, mtp="dense", mtp_d_ff=384)
    assert cfg.n_layers == 1 and cfg.n_nextn == 1        # the MTP block is not a main layer
    _, hc = find_mtp_head(f, cfg)
    assert (hc.layer, hc.moe, hc.d_ff, hc.sidecar, hc.path) == (1, False, 384, False, f.path)


def test_sidecar_by_name_and_explicit(tmp_path):
    f, cfg = _model(tmp_path)
    assert find_mtp_head(f, cfg) is None
    side = sidecar_path(f.path)
    assert side == str(tmp_path / "m.mtp.gguf")
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=1), side)
    head, hc = find_mtp_head(f, cfg)
    assert hc.sidecar and hc.path == side and head.path == side
    other = tmp_path / "heads" / "any-name.gguf"
    other.parent.mkdir()
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=1, seed=3), other)
    assert find_mtp_head(f, cfg, str(other))[1].path == str(other)     # explicit wins over the sibling


def test_wrong_heads_are_clear_errors(tmp_path):
    f, cfg = _model(tmp_path)
    with pytest.raises(GGUFError, match="--draft-head file not found"):
        find_mtp_head(f, cfg, str(tmp_path / "missing.gguf"))
    wide = tmp_path / "wide.gguf"
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=1, d_model=128, d_ff=256), wide)
    with pytest.raises(GGUFError, match="embedding_length is 128, the model has 256"):
        find_mtp_head(f, cfg, str(wide))
    llama = tmp_path / "llama.gguf"
    write_mtp_sidecar(PRESETS["tiny-llama"](n_layers=1), llama)
    with pytest.raises(GGUFError, match="architecture 'llama', the model is 'qwen3'"):
        find_mtp_head(f, cfg, str(llama))
    deep = tmp_path / "deep.gguf"
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=2), deep)
    with pytest.raises(GGUFError, match="block_count = 3"):
        find_mtp_head(f, cfg, str(deep))
    # a sidecar that lost a tensor
    good = tmp_path / "good.gguf"
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=1), good)
    src = GGUFFile(good)
    broken = tmp_path / "broken.gguf"
    w = GGUFWriter(str(broken), "qwen3")
    for k, v in src.metadata.items():
        if k.startswith("qwen3."):
            (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    for name, t in src.tensors.items():
        if name != "blk.1.nextn.eh_proj.weight":
            w.add_tensor(name, np.asarray(t.data).view(np.float32).reshape(t.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.nextn.eh_proj.weight'"):
        find_mtp_head(f, cfg, str(broken))


def test_nextn_count_checked(tmp_path):
    from alphallama.gguf.arch import config_from_metadata
    md = dict(GGUFFile(_model(tmp_path)[0].path).metadata)
    md["qwen3.block_count"], md["qwen3.nextn_predict_layers"] = 2, 1
    assert config_from_metadata(md).n_layers == 1 and config_from_metadata(md).n_nextn == 1
    md["qwen3.nextn_predict_layers"] = 2
    with pytest.raises(GGUFError, match="nextn_predict_layers = 2 but block_count = 2"):
        config_from_metadata(md)


def test_inspect_reports_the_head(tmp_path):
    from alphallama.cli_inspect import describe
    f, _ = _model(tmp_path)
    assert describe(f.path)["mtp_head"] is None
    side = sidecar_path(f.path)
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=1, mtp_d_ff=384), side)
    assert describe(f.path)["mtp_head"] == {"path": side, "sidecar": True, "layer": 1, "ffn": "dense 384"}
    write_mtp_sidecar(PRESETS["tiny-qwen3"](n_layers=2), side)      # a head for another model
    assert "error" in describe(f.path)["mtp_head"]

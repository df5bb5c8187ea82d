"""Training state is never unpickled into arbitrary objects and never kept in a shared
fixed /tmp path: the work folder is the user's own (0700), and the checkpoint and the
data cache load with weights_only=True, so a planted file is refused, not executed."""
from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from alphallama.config import DEFAULTS
from alphallama.private_dir import UnsafePathError, private_dir
from alphallama.train.loop import State, load, save
from alphallama.train.pipeline import load_data_cache, save_data_cache


class _Planted:
    """Unpickling this touches a marker file: the stand-in for code an attacker runs."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _parts():
    model, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()])
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, head, opt


def test_checkpoint_round_trips_with_weights_only(tmp_path):
    model, head, opt = _parts()
    st = State(step=7, trained_s=1.5, tokens=99, curves={"train": [[1, 2.0]], "val": []})
    save(tmp_path / "ckpt.pt", model, head, opt, st)
    m2, h2 = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    o2 = torch.optim.AdamW([*m2.parameters(), *h2.parameters()])
    assert load(tmp_path / "ckpt.pt", m2, h2, o2) == st
    assert torch.equal(m2.weight, model.weight) and o2.state_dict()["state"][0]["step"] == 1


def test_planted_checkpoint_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model": _Planted(marker)}, tmp_path / "ckpt.pt")
    torch.load(tmp_path / "ckpt.pt", weights_only=False)   # the file is armed: a full unpickle runs it
    assert marker.exists()
    marker.unlink()
    model, head, opt = _parts()
    assert load(tmp_path / "ckpt.pt", model, head, opt) is None
    assert not marker.exists()


def test_data_cache_round_trips_and_refuses_pickles(tmp_path):
    key = {"seed": 1, "root": None}
    d = {"key": key, "train": np.arange(10, dtype=np.uint16), "val": np.arange(3, dtype=np.uint16),
         "tokenizer": "{}", "manifest_sha": "ab", "corpus": {"files": 2, "examples": {"qa": 1}}}
    save_data_cache(d, tmp_path / "data.pt")
    back = load_data_cache(tmp_path / "data.pt", key)
    assert back["train"].dtype == np.uint16 and np.array_equal(back["train"], d["train"])
    assert {k: v for k, v in back.items() if k not in ("train", "val")} == \
        {k: v for k, v in d.items() if k not in ("train", "val")}
    assert load_data_cache(tmp_path / "data.pt", {**key, "seed": 2}) is None   # other arguments: a miss
    marker = tmp_path / "ran"
    with open(tmp_path / "data.pt", "wb") as fh:   # a plain pickle, as the old format was
        pickle.dump({"key": key, "x": _Planted(marker)}, fh, protocol=2)
    assert load_data_cache(tmp_path / "data.pt", key) is None
    assert not marker.exists()


def test_work_dirs_default_to_a_private_per_user_folder():
    for work in (DEFAULTS.train.work_dir, DEFAULTS.distill.work_dir):
        p = Path(work).expanduser()
        assert not str(p).startswith("/tmp") and str(p).startswith(str(Path.home()))


def test_the_work_folder_is_created_private_and_another_users_is_refused(tmp_path):
    work = private_dir(tmp_path / "a" / "work")
    assert stat.S_IMODE(work.stat().st_mode) == 0o700 and work.stat().st_uid == os.geteuid()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    if os.geteuid() == 0:   # a real other user's folder where we can make one
        os.chown(shared, 4242, -1)
        with pytest.raises(UnsafePathError, match="belongs to uid 4242"):
            private_dir(shared)
    with pytest.raises(UnsafePathError, match=f"belongs to uid {shared.stat().st_uid}, not to this user"):
        private_dir(shared, owner=4243)


def test_the_pipeline_refuses_an_unsafe_work_folder(tmp_path, capsys):
    from alphallama.train.__main__ import main
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert main(["run", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "link")]) == 2
    assert "not a plain directory" in capsys.readouterr().err

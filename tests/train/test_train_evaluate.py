"""train/evaluate.py: held-out continuation prompts by hand, and the before/after flow on
the shipped embedded model (CPU): a model evaluated alone, then against that record with
--baseline-json, over several processes, gives the same numbers as 'before' and 'after'
(greedy decoding is deterministic), and the side-by-side table names every measure."""
from __future__ import annotations

import gzip
import json
import sysconfig
from importlib import resources
from pathlib import Path

import pytest

from alphallama.train.evaluate import SAMPLE_CHATS, continuation_prompts, main

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def test_continuation_prompts_by_hand():
    a = '"""Mod."""\nimport os\n\n\ndef f(x):\n    """Return x."""\n    return x\n'
    only_doc = 'def g():\n    """Nothing else."""\n'                       # no body to write
    nested = 'class C:\n    def m(self):\n        """Doc."""\n        return 1\n'
    long = "x = 1\n" * 400 + a
    broken = "def (:\n"
    got = continuation_prompts([a, only_doc, nested, long, broken], 5, seed=0)
    assert sorted(got) == sorted(['"""Mod."""\nimport os\n\n\ndef f(x):\n    """Return x."""\n',
                                  'class C:\n    def m(self):\n        """Doc."""\n'])
    assert len(continuation_prompts([a, nested], 1, seed=0)) == 1


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    p = tmp_path_factory.mktemp("h") / "heldout.jsonl.gz"
    with gzip.open(p, "wt") as f:
        for n in ("textwrap.py", "shlex.py", "glob.py", "fnmatch.py", "colorsys.py", "bisect.py", "heapq.py"):
            f.write(json.dumps({"path": n, "sha256": "", "text": (STDLIB / n).read_text()}) + "\n")
    return p


def test_before_then_after_against_its_record(tmp_path, heldout, capsys):
    model = str(resources.files("alphallama").joinpath("data/alphallama-embedded.gguf"))
    common = ["--heldout", str(heldout), "--per-kind", "1", "--windows", "2", "--continuations", "2",
              "--max-tokens", "12"]
    before = tmp_path / "before.json"
    assert main([model, *common, "--jobs", "2", "-o", str(before)]) == 0
    rec = json.loads(before.read_text())
    assert rec["side_by_side"] is None and len(rec["task_set"]) == 8
    s = rec["results"]["after"]["samples"]
    assert len(s["chat"]) == len(SAMPLE_CHATS) and len(s["heldout_continuation"]) == 2
    assert all(isinstance(c["plausible"], bool) and (c["defines_function"] or not c["plausible"]) for c in s["chat"])
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main([model, *common, "--baseline-json", str(before), "-o", str(out)]) == 0
    table = capsys.readouterr().out
    side = json.loads(out.read_text())["side_by_side"]
    for key in ("heldout_bits_per_byte", "chat_plausible", "chat_defines_function", "chat_repeat_share",
                "heldout_continuation_repeat_share", "write_function", "unchanged"):
        assert key in side and side[key]["before"] == side[key]["after"], key
        assert key in table
    # a record made with other settings is refused, not compared
    with pytest.raises(SystemExit):
        main([model, *common[:-1], "13", "--baseline-json", str(before), "-o", str(out)])


def test_device_script_parses_and_names_what_exists():
    """bench/gpu_train_embedded.sh (smoked whole on the CPU: its header) is valid bash, and
    the modules, scripts and flags it calls exist."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    script = root / "bench" / "gpu_train_embedded.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    assert (root / "bench" / "train_step_cost.py").exists()
    import argparse

    from alphallama.train import pipeline
    p = argparse.ArgumentParser()
    from alphallama.config import DEFAULTS
    pipeline.add_arguments(p, DEFAULTS.train)
    flags = {o for a in p._actions for o in a.option_strings}
    for flag in ("--deadline-s", "--time-budget-s", "--checkpoint-every-s", "--work-dir", "--device", "--commit"):
        assert flag in text and flag in flags
    for flag in ("--baseline-json", "--heldout", "--jobs", "--commit"):
        assert flag in text

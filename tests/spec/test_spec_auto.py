"""--spec-type auto, the default of `run` and `serve`: the copy drafter (exact mode) on a
GPU, plain decoding on the CPU; the library's SpecConfig() stays plain."""
from __future__ import annotations

import argparse

import pytest

from alphallama.config import DEFAULTS
from alphallama.engine import Engine, Generation
from alphallama.spec.config import AUTO, SpecConfig, add_spec_arguments, spec_from_args
from alphallama.spec.ngram import NgramDrafter


def _args(*argv):
    p = argparse.ArgumentParser()
    add_spec_arguments(p)
    return p.parse_args(list(argv))


def test_cli_default_is_auto_and_library_default_is_plain():
    assert spec_from_args(_args()).spec_type == AUTO == DEFAULTS.spec.cli_spec_type
    assert spec_from_args(_args("--spec-type", "none")).spec_type == "none"
    assert SpecConfig().spec_type == "none"
    with pytest.raises(SystemExit):
        _args("--spec-type", "fastest")


def test_auto_resolves_by_device():
    auto = SpecConfig(spec_type=AUTO, draft_max=9)
    gpu, cpu = auto.on_device("cuda"), auto.on_device("cpu")
    assert gpu.spec_type == DEFAULTS.spec.auto_cuda == "ngram" and gpu.draft_max == 9
    assert cpu.spec_type == "none"
    assert gpu.memory is auto.memory and cpu.memory is auto.memory     # what was measured and learnt is kept
    assert SpecConfig(spec_type="mtp").on_device("cuda").spec_type == "mtp"   # an explicit choice wins
    d = gpu.make_drafter()                                               # (replay: no engine, the copy alone)
    assert isinstance(d, NgramDrafter) and d.draft_max == 9
    assert auto.make_drafter() is None                                   # no engine: plain


def test_auto_on_a_cpu_engine_decodes_plainly(stories_path):
    eng = Engine.load(str(stories_path), ctx_size=256)
    ids = eng.tokenizer.encode("Once upon a time")
    g_auto, g_none = Generation(), Generation()
    auto = list(eng.generate(ids, 12, gen=g_auto, spec=SpecConfig(spec_type=AUTO)))
    eng.reset()
    plain = list(eng.generate(ids, 12, gen=g_none))
    assert auto == plain and g_auto.spec.tokens_per_round == 1.0

"""Logit bias and repetition penalties (penalties.py) against a float64 numpy transcription
of llama.cpp's samplers (llama_sampler_logit_bias_apply, then llama_sampler_penalties_apply
over a window of the last penalty_last_n accepted tokens), row by row of a verify round."""
from __future__ import annotations

import argparse
import collections
import math

import numpy as np
import pytest
import torch

from alphallama.cli_run import logit_bias_flag
from alphallama.penalties import Penalties, penalize
from alphallama.sampling import SamplingParams

V = 40          # a small vocabulary: histories repeat tokens


def reference_row(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's logit bias then penalties for one row, in float64. logits [V]; history: every
    token before the row (prompt, output, the drafts before it)."""
    x = logits.astype(np.float64).copy()
    for tid, bias in p.logit_bias:
        x[tid] += bias
    if p.repeat_last_n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                                and p.frequency_penalty == 0.0):
        return x
    window = history if p.repeat_last_n == -1 else history[-p.repeat_last_n:]
    for tid, count in collections.Counter(window).items():
        x[tid] = x[tid] * p.repeat_penalty if x[tid] <= 0 else x[tid] / p.repeat_penalty
        x[tid] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    return x


PARAMS = [SamplingParams(repeat_penalty=1.3),
          SamplingParams(repeat_penalty=0.7, repeat_last_n=3),
          SamplingParams(presence_penalty=1.5, repeat_last_n=1),
          SamplingParams(frequency_penalty=0.8, repeat_last_n=-1),
          SamplingParams(repeat_penalty=1.1, presence_penalty=-0.5, frequency_penalty=2.0, repeat_last_n=5),
          SamplingParams(repeat_penalty=1.8, presence_penalty=0.4, frequency_penalty=-1.2, repeat_last_n=64,
                         logit_bias=((3, 5.0), (7, -100.0), (3, -1.5), (11, -math.inf))),
          SamplingParams(logit_bias=((0, 100.0), (39, -7.25)))]


def _case(seed: int, n_hist: int, w: int) -> tuple[torch.Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(w, V, generator=g) * 4                                  # [W, V], both signs
    logits[:, :4] = torch.tensor([0.0, -0.0, 1e-3, -1e-3])                       # the <= 0 branch's edge
    history = torch.randint(12, (n_hist,), generator=g).tolist()                 # few distinct tokens
    drafts = torch.randint(12, (w - 1,), generator=g).tolist()
    return logits, history, drafts


@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
@pytest.mark.parametrize("n_hist,w", [(1, 1), (2, 6), (9, 8), (70, 16), (200, 3)])
def test_rows_match_llamacpp_row_by_row(p, n_hist, w):
    logits, history, drafts = _case(n_hist * 31 + w, n_hist, w)
    got = Penalties(p, history, V).rows(logits, drafts)                          # [W, V]
    for i in range(w):
        ref = reference_row(logits[i].numpy(), history + drafts[:i], p)
        np.testing.assert_allclose(got[i].double().numpy(), ref, rtol=1e-6, atol=1e-5, err_msg=f"row {i}")


def test_penalize_is_llamacpps_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(200, generator=g) * 10, torch.tensor([0.0, -0.0, 3.0, -3.0])])   # [M]
    c = torch.randint(1, 9, x.shape, generator=g)
    for rp, pp, fp in [(1.0, 0.0, 0.0), (1.25, 0.0, 0.0), (0.5, 0.3, 0.0), (2.0, -2.0, 1.5), (1.1, 2.0, -2.0)]:
        xd, cd = x.double().numpy(), c.double().numpy()
        ref = np.where(xd <= 0, xd * rp, xd / rp) - (cd * fp + (cd > 0) * pp)
        np.testing.assert_allclose(penalize(x, c, rp, pp, fp).double().numpy(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_row_i_is_what_plain_decoding_computes_after_drafts_before_it(p):
    """The exactness invariant, bit for bit: row i of a round == the one row plain decoding
    computes after committing drafts[:i] (same logits in, same bits out)."""
    logits, history, drafts = _case(5, 30, 10)
    wide = Penalties(p, history, V).rows(logits, drafts)
    plain = Penalties(p, history, V)
    for i in range(len(drafts) + 1):
        assert torch.equal(wide[i], plain.rows(logits[i:i + 1], [])[0]), i
        if i < len(drafts):
            plain.commit(drafts[i])


def test_rows_leave_their_input_and_the_state_alone():
    logits, history, drafts = _case(7, 20, 6)
    before = logits.clone()
    pen = Penalties(PARAMS[4], history, V)
    first = pen.rows(logits, drafts)
    assert torch.equal(logits, before)                                           # a graph's buffer stays
    assert torch.equal(pen.rows(logits, drafts), first)                          # no draft was committed


def test_off_unless_asked():
    assert Penalties.start(SamplingParams(), [1, 2, 3], V) is None               # llama.cpp's defaults: off
    assert Penalties.start(SamplingParams(repeat_penalty=1.5, repeat_last_n=0), [1, 2], V) is None   # 0: off
    assert not SamplingParams(presence_penalty=1.0, repeat_last_n=0).penalized
    only_bias = Penalties.start(SamplingParams(logit_bias=((2, 1.0),)), [2, 2, 2], V)
    x = torch.zeros(1, V)
    assert only_bias.rows(x, [])[0].tolist() == [0.0, 0.0, 1.0] + [0.0] * (V - 3)


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.01), dict(frequency_penalty=-2.5), dict(repeat_penalty=0.0),
                                dict(repeat_penalty=-1.0), dict(repeat_penalty=101.0), dict(repeat_last_n=-2),
                                dict(logit_bias=((1, 100.5),)), dict(logit_bias=((-1, 1.0),)),
                                dict(logit_bias=((1, math.nan),)), dict(logit_bias=((1, math.inf),))])
def test_out_of_range_values_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).validate()


def test_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Penalties(SamplingParams(logit_bias=((V, 1.0),)), [], V)


def test_cli_logit_bias_flag():
    assert logit_bias_flag("15043+1") == (15043, 1.0)
    assert logit_bias_flag("15043-2.5") == (15043, -2.5)
    assert logit_bias_flag("7-inf") == (7, -math.inf)
    for bad in ("15043", "x+1", "15043*2", "15043+abc"):
        with pytest.raises(argparse.ArgumentTypeError):
            logit_bias_flag(bad)


def _parse(*argv: str):
    from alphallama.cli import build_parser
    return build_parser(list(argv)).parse_args(list(argv))


@pytest.mark.parametrize("command", [["run", "-p", "x"], ["serve"]])
def test_cli_flags_are_llamacpps(command):
    from alphallama.cli_run import sampling_from_args
    a = _parse(*command, "--repeat-penalty", "1.3", "--repeat-last-n", "-1", "--presence-penalty", "0.5",
               "--frequency-penalty", "-0.2", "-l", "13-inf", "--logit-bias", "278+2")
    s = sampling_from_args(a)
    assert (s.repeat_penalty, s.repeat_last_n, s.presence_penalty, s.frequency_penalty) == (1.3, -1, 0.5, -0.2)
    assert s.logit_bias == ((13, -math.inf), (278, 2.0))
    assert sampling_from_args(_parse(*command)) == SamplingParams()      # unset: off, as llama.cpp


def _cli(*argv: str):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "alphallama", *argv], capture_output=True, text=True, timeout=120)


def test_cli_run_applies_them(stories_path):
    import json

    from alphallama.engine import Engine
    flags = ["--repeat-penalty", "1.4", "--repeat-last-n", "16", "--presence-penalty", "0.3", "-l", "278-inf"]
    proc = _cli("run", "-m", str(stories_path), "-p", "Once upon a time", "-n", "40", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    e = Engine.load(str(stories_path))
    p = SamplingParams(repeat_penalty=1.4, repeat_last_n=16, presence_penalty=0.3, logit_bias=((278, -math.inf),))
    assert out["gen_ids"] == list(e.generate(out["prompt_ids"], 40, p)) != list(e.generate(out["prompt_ids"], 40))


@pytest.mark.parametrize("flag, says", [(["--presence-penalty", "3"], "presence_penalty"),
                                        (["--repeat-penalty", "0"], "repeat_penalty"),
                                        (["-l", "5+200"], "logit_bias")])
def test_cli_refuses_out_of_range_before_loading(stories_path, flag, says):
    proc = _cli("run", "-m", str(stories_path), "-p", "x", *flag)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and says in proc.stderr.strip().splitlines()[-1]
    assert "reading the weights" not in proc.stderr

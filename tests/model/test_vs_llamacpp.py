"""Greedy generation against llama.cpp's recorded outputs (../shared/data/reference)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from alphallama.engine import Engine, Generation
from conftest import REFERENCE


def _cases(name):
    return json.loads((REFERENCE / name).read_text())["cases"]


def _prompt_ids(engine, case):
    if case["kind"] == "chat":
        return engine.encode_chat([{"role": "user", "content": case["input"]}])
    return engine.encode_prompt(case["input"])


@pytest.fixture(scope="module")
def stories(stories_path):
    return Engine.load(str(stories_path), ctx_size=512)


def test_stories_greedy_equals_llamacpp(stories):
    for case in _cases("stories260K.json"):
        ids = _prompt_ids(stories, case)
        assert ids == case["prompt_ids"]
        gen = Generation()
        out = list(stories.generate(ids, len(case["gen_ids"]), gen=gen))
        assert out == case["gen_ids"], case["input"]
        assert stories.tokenizer.decode(out, continuation=True) == case["text"]
        assert gen.finish_reason == "length" and gen.stats.predicted_n == len(out)


def test_stories_top5_logprobs_match(stories):
    """Teacher-force llama.cpp's tokens and compare the top-5 log-probabilities.
    llama.cpp keeps its KV cache in f16 (we use f32), which moves log-probabilities
    by up to ~0.01 late in the sequence; the argmax and its probability must agree."""
    case = _cases("stories260K.json")[0]
    ids = case["prompt_ids"] + case["gen_ids"]
    cache = stories.model.new_cache(256)
    logits, _ = stories.model.forward(torch.tensor(ids), 0, cache)
    logp = torch.log_softmax(logits.double(), -1)
    for i, top5 in enumerate(case["top5"]):
        row = logp[len(case["prompt_ids"]) - 1 + i]
        assert int(row.argmax()) == top5[0][0]
        assert abs(row[top5[0][0]].item() - top5[0][1]) < 5e-3, i
        for tok, lp in top5:
            assert abs(row[tok].item() - lp) < 0.03, (i, tok)


def test_cli_run_json(stories_path):
    case = _cases("stories260K.json")[1]
    r = subprocess.run([sys.executable, "-m", "alphallama.cli", "run", "-m", str(stories_path), "-p", case["input"],
                        "-n", "24", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == case["prompt_ids"]
    assert out["gen_ids"] == case["gen_ids"][:24]


# llama.cpp's own numeric noise on this model: teacher-forcing its tokens, its top-2
# log-probabilities differ from exact float32 math (ours, and tests/reference_f64.py,
# which agree to 2e-5) by 0.056 on average, up to 0.2; it rounds activations to 8 bits
# before every quantized product. One reference prompt diverges at a near-tie of
# 0.063 (our token is llama.cpp's second, and exact math's first); see docs/decisions/llamacpp-agreement.md.
NEAR_TIE = 0.1


def _first_divergence_is_near_tie(ours, case):
    """Where our greedy token first differs, it must be one of llama.cpp's top two and
    those two must lie within NEAR_TIE in log-probability."""
    for i, (a, b) in enumerate(zip(ours, case["gen_ids"])):
        if a != b:
            (t1, lp1), (t2, lp2) = case["top5"][i][:2]
            assert a in (t1, t2) and abs(lp1 - lp2) <= NEAR_TIE, (i, a, case["top5"][i][:2])
            return i, abs(lp1 - lp2)
    return None


@pytest.mark.slow
@pytest.mark.shared
def test_qwen_greedy_matches_llamacpp(qwen_path):
    engine = Engine.load(str(qwen_path), ctx_size=512)
    assert "Qwen" in engine.gguf.metadata["general.name"]
    report = []
    for case in _cases("qwen2.5-coder-0.5b-instruct.json"):
        ids = _prompt_ids(engine, case)
        assert ids == case["prompt_ids"], case["input"]
        out = list(engine.generate(ids, len(case["gen_ids"])))
        div = _first_divergence_is_near_tie(out, case)
        report.append((case["input"][:30], div))
        if div is None:
            assert out == case["gen_ids"]
            assert engine.tokenizer.decode(out, continuation=True) == case["text"]
    print(report)
    # Measured: two prompts match all 64 tokens; "Write a Python function" departs at
    # position 44 (gap 0.002) and "Rename the function" at 60 (gap 0.063, see NEAR_TIE).
    assert sum(d is None for _, d in report) >= 2, report


@pytest.mark.slow
@pytest.mark.shared
def test_qwen_answers_chat_sensibly(qwen_path):
    engine = Engine.load(str(qwen_path), ctx_size=512)
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    text = engine.tokenizer.decode(list(engine.generate(ids, 16)), continuation=True)
    assert "Paris" in text

"""The warm-up at load leaves nothing a request could see: the same tokens as an engine
that never warmed up, no prefix re-used from it, nothing learned kept but the cost table."""
from __future__ import annotations

import itertools

import pytest

from alphallama.cli_run import resolve_model
from alphallama.engine import Engine, Generation
from alphallama.sampling import SamplingParams
from alphallama.spec.config import SpecConfig
from alphallama.warmup import WarmRun, warm_up, warmup_prompt, warmup_runs

pytestmark = pytest.mark.usefixtures("one_thread")


def _spec(tmp_path) -> SpecConfig:
    # the embedded model has an MTP head: both drafters, the policy and the priced gate run. The
    # policy prices MTP's drafts by the head's measured ms: a clock that advances 0.5 ms a reading
    # (not the wall's) gives the warm and the cold engine the same prices, so the same drafts
    ticks = itertools.count()
    return SpecConfig("mtp,ngram", cost_cache_dir=str(tmp_path), cost_budget_s=0.05, clock=lambda: 5e-4 * next(ticks))


def test_a_request_after_the_warmup_is_what_it_is_without_one(tmp_path):
    path = resolve_model(None)
    warm, cold = (Engine.load(path, ctx_size=1024, device="cpu") for _ in range(2))
    spec_warm = _spec(tmp_path)
    runs = [WarmRun(600), WarmRun(129), WarmRun(129, SamplingParams(temperature=0.8, top_p=0.9, seed=1), 2)]
    warm_up(warm, spec_warm, runs)         # runs of the GPU's kind: long prompts (a full chunk, ragged ones), sampled
    assert warm.cache.length == 0 and warm.cached == [] and warm.mtp.length == 0
    (mem,) = spec_warm.memory.models.values()
    assert mem.table is not None and not mem.table.from_cache          # timed now, at load
    assert mem.policy.rates == {} and mem.policy.decisions == {}       # what it learned: thrown away
    spec_cold = _spec(tmp_path)            # a cold engine's first request reads the same table from disk
    prompt = warmup_prompt(warm, 40)       # the warm-up's own text: nothing of it may be re-used
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=7)):
        gw, gc = Generation(), Generation()
        got = list(warm.generate(prompt, 16, sampling, gen=gw, spec=spec_warm))
        want = list(cold.generate(prompt, 16, sampling, gen=gc, spec=spec_cold))
        assert got == want and len(got) > 0
        assert gw.stats.prompt_reused == gc.stats.prompt_reused
        assert gw.spec.to_dict() == gc.spec.to_dict()       # the same drafts, widths and acceptances
    assert gw.stats.prompt_reused == len(prompt) - 1        # (the second request re-used the first's rows)


def test_warmup_runs_fit_the_context():
    engine = Engine.load(resolve_model(None), ctx_size=12, device="cpu")
    (run,) = warmup_runs(engine)
    rows = run.rows
    assert 1 <= rows <= 12 - 5
    ids = warmup_prompt(engine, rows)
    assert len(ids) == rows and not set(ids) & set(engine.tokenizer.stop_ids)
    warm_up(engine, SpecConfig("none"))
    assert engine.cache.length == 0 and engine.cached == []


def test_gpu_runs_take_every_prefill_shape():
    """On the GPU every captured prefill shape, at position 0 and after it, and the sampler."""
    from types import SimpleNamespace

    import torch

    from alphallama.config import DEFAULTS
    from alphallama.runtime.gpu_model import MAX_W
    from alphallama.runtime.gpu_prefill import graph_rows
    chunk = DEFAULTS.engine.prefill_chunk
    for ctx in (4096, 700):
        gpu = SimpleNamespace(ctx_size=ctx, cache=SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"))))
        runs = warmup_runs(gpu)
        taken = set()
        for run in runs:                  # Engine.prefill: chunks of `chunk` rows, then the last row alone
            assert run.rows < ctx
            for s in range(0, run.rows - 1, chunk):
                T = min(chunk, run.rows - 1 - s)
                if T > MAX_W:
                    taken.add((graph_rows(T, chunk), s > 0))
        shapes = {graph_rows(T, chunk) for T in range(MAX_W + 1, min(chunk, ctx - 1) + 1)}
        assert {t for t, _ in taken} == shapes and any(after for _, after in taken) == (ctx > chunk + MAX_W + 8)
        assert any(r.sampling.temperature > 0 and r.logprobs for r in runs)

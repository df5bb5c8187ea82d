"""Parallel streams for the tests: several prompts driven through streams.Streams' rounds on one
engine, each stream's tokens collected (to compare with the stream's tokens alone).

Test modules import it by name (`from streamutil import drive`: tests/ is on sys.path, as for
tests/conftest.py)."""
from __future__ import annotations

from alphallama.engine import Engine, Generation
from alphallama.spec.gate import MAX_WIDTH
from alphallama.streams import StreamRun, Streams


def drive(e: Engine, prompts: list[list[int]], n_new: int, spec=None, *, starts: list[int] | None = None,
          stop_after: dict[int, int] | None = None, stop_ids: set[int] | None = None, max_rows: int = MAX_WIDTH,
          rounds: list | None = None, max_steps: int = 100) -> tuple[list[list[int]], list[Generation], list[StreamRun]]:
    """Stream i (prompts[i], at most n_new tokens) is added at step starts[i] (default i: one step
    apart) or, all slots busy, once a slot is free after it; at most one stream joins a step.
    spec: every stream's, or a list of one per stream (None: the engine's default);
    stop_after {i: n}: stream i's on_token stops it after n tokens (the others run to n_new or a
    token of stop_ids: None, the tokenizer's end-of-generation tokens); max_rows: a round's most
    rows (Streams); rounds: receives (the streams in the round, its rows) per round.
    Every stream ends without an error within max_steps steps, and every slot is free after.
    -> (each stream's tokens, its Generation, its StreamRun)."""
    streams = Streams(e, max_rows)
    starts = list(range(len(prompts))) if starts is None else starts
    specs = spec if isinstance(spec, list) else [spec] * len(prompts)
    got: list[list[int]] = [[] for _ in prompts]
    gens = [Generation() for _ in prompts]

    def taker(i):
        def on_token(t):
            got[i].append(t)
            return len(got[i]) < (stop_after or {}).get(i, n_new + 1)
        return on_token
    runs: list[StreamRun] = []
    step = 0
    while len(runs) < len(prompts) or streams.runs:
        i = len(runs)
        if i < len(prompts) and step >= starts[i] and streams.free:
            kw = {} if specs[i] is None else {"spec": specs[i]}
            runs.append(streams.add(prompts[i], n_new, taker(i), gen=gens[i], stop_ids=stop_ids, **kw))
        before = sum(len(r.rows) for r in runs)
        for r in streams.step():
            assert r.error is None, r.error
        if rounds is not None and sum(len(r.rows) for r in runs) > before:
            rounds.append((sum(len(r.rows) for r in runs) - before, streams.width))
        step += 1
        assert step < max_steps
    assert not any(s.busy for s in e.slots)
    return got, gens, runs

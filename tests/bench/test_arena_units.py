"""Arena harness pieces without a server: SSE parsing, suites, the schedule, arm
specs, the figures from `timings`, and the statistics."""
from __future__ import annotations

import json
import math

import pytest

from alphallama.bench import schedule
from alphallama.bench.arms import ArmError, api_root, parse_arm
from alphallama.bench.client import Measurement, apply_timings
from alphallama.bench.sse import SSEDecoder
from alphallama.bench.stats import geomean, summarize
from alphallama.bench.suite import SuiteError, load_suite, parse_prompts, select


# --- SSE -------------------------------------------------------------------------

def test_sse_events_split_anywhere():
    text = 'data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: line1\ndata: line2\n\ndata: [DONE]\n\n'
    for cut in range(1, len(text)):         # every split point, including inside CRLF
        dec = SSEDecoder()
        events = dec.feed(text[:cut]) + dec.feed(text[cut:]) + dec.finish()
        assert [(e.event, e.data) for e in events] == [
            ("message", '{"a": 1}'), ("x", "line1\nline2"), ("message", "[DONE]")], cut


def test_sse_last_event_without_blank_line():
    dec = SSEDecoder()
    assert dec.feed("data: a\n\ndata:b")[0].data == "a"
    assert [e.data for e in dec.finish()] == ["b"]


# --- suite -----------------------------------------------------------------------

def test_public_suite_ships_in_package():
    suite = load_suite()
    assert suite.source == "package:arena-public.jsonl"
    assert len(suite.prompts) == 25
    assert suite.sets() == ["A", "V", "R"]
    assert [p.id for p in suite.prompts[:2]] == ["A01", "A02"]


def test_select_sets_ids_count_and_scale():
    suite = load_suite()
    assert [p.id for p in select(suite, ["R"], "2").prompts] == ["R01", "R02"]
    assert [p.id for p in select(suite, None, "1").prompts] == ["A01", "V01", "R01"]
    assert [p.id for p in select(suite, None, "R03,A02").prompts] == ["A02", "R03"]   # suite order
    scaled = select(suite, ["A"], "A02", max_tokens_scale=0.25).prompts[0]
    assert scaled.max_tokens == 32          # 128 * 0.25
    with pytest.raises(SuiteError):
        select(suite, None, "Z99")
    with pytest.raises(SuiteError):
        select(suite, ["Q"])


def test_suite_validation():
    good = {"id": "X", "set": "A", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    assert parse_prompts(json.dumps(good))[0].max_tokens == 4
    with pytest.raises(SuiteError, match="duplicate"):
        parse_prompts(json.dumps(good) + "\n" + json.dumps(good))
    with pytest.raises(SuiteError, match="max_tokens"):
        parse_prompts(json.dumps({**good, "max_tokens": 0}))


# --- schedule --------------------------------------------------------------------

def _ids(block):
    return [(s.arm, s.prompt.id, s.order) for s in block.steps]


def test_schedule_blocks_reverse_prompts_and_arms():
    prompts = select(load_suite(), ["A"], "3").prompts
    blocks = schedule.plan(("a", "b"), prompts, passes=2, interleave=False)
    assert [(b.pass_no, b.arms) for b in blocks] == [(1, ("a",)), (1, ("b",)), (2, ("b",)), (2, ("a",))]
    assert _ids(blocks[0]) == [("a", "A01", 0), ("a", "A02", 1), ("a", "A03", 2)]
    assert _ids(blocks[2]) == [("b", "A03", 0), ("b", "A02", 1), ("b", "A01", 2)]


def test_schedule_interleaved():
    prompts = select(load_suite(), ["A"], "2").prompts
    blocks = schedule.plan(("a", "b"), prompts, passes=2, interleave=True)
    assert len(blocks) == 2
    assert _ids(blocks[0]) == [("a", "A01", 0), ("b", "A01", 0), ("a", "A02", 1), ("b", "A02", 1)]
    assert _ids(blocks[1]) == [("b", "A02", 0), ("a", "A02", 0), ("b", "A01", 1), ("a", "A01", 1)]


# --- arms ------------------------------------------------------------------------

def test_parse_arm():
    assert parse_arm("x=http://127.0.0.1:8080/v1/").url == "http://127.0.0.1:8080"
    assert parse_arm("ours=alphallama serve -m M --port {port}").kind == "cmd"
    assert api_root("http://h:1") == "http://h:1"
    for bad in ("noequals", "x=", "x=llama-server -m M", "bad name=http://h", "x=cmd 'open"):
        with pytest.raises(ArmError):
            parse_arm(bad)


# --- per-request figures -----------------------------------------------------------

def test_apply_timings():
    m = Measurement()
    apply_timings(m, {"prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 120, "predicted_ms": 800.0,
                      "predicted_per_second": 150.0, "rounds": 40, "draft_n": 90, "draft_n_accepted": 80})
    assert m.server_tps == pytest.approx(150.0)
    assert m.prefill_tps == pytest.approx(2000.0)
    assert (m.rounds, m.tokens_per_round, m.ms_per_round) == (40, 3.0, 20.0)
    assert m.acceptance == pytest.approx(80 / 90)
    plain = Measurement()
    apply_timings(plain, {"predicted_n": 10, "predicted_ms": 100.0})   # llama-server: no rounds
    assert plain.server_tps == pytest.approx(100.0) and plain.tokens_per_round is None
    none = Measurement()
    apply_timings(none, None)
    assert none.server_tps is None


# --- statistics ------------------------------------------------------------------

def _sample(arm, pass_no, pid, pset, server=None, client=None, ok=True, tokens=10):
    return {"arm": arm, "pass": pass_no, "prompt": pid, "set": pset, "ok": ok,
            "error": None if ok else "boom", "server_tps": server, "client_tps": client,
            "ttft_s": 0.01, "tokens": tokens}


def test_summarize_means_flags_geomeans_and_speed_index():
    prompts = [{"id": "a1", "set": "A"}, {"id": "a2", "set": "A"}, {"id": "v1", "set": "V"}]
    rates = {"c": {"a1": (100, 105), "a2": (50, 50), "v1": (20, 30)},     # v1: +50% -> flagged
             "x": {"a1": (200, 200), "a2": (80, 90), "v1": (40, 44)}}     # a2: 12.5% flagged; v1: 10% is not "more than"
    samples = [_sample(arm, k + 1, pid, pid[0].upper(), server=r[k], client=r[k] * 0.9)
               for arm, per in rates.items() for pid, r in per.items() for k in range(2)]
    s = summarize(samples, prompts, ["c", "x"], "c", passes=2)
    means = {a: {p: sum(r) / 2 for p, r in per.items()} for a, per in rates.items()}
    assert s["arms"]["x"]["prompts"]["a2"]["mean"] == 85
    gm_a = math.sqrt(means["x"]["a1"] * means["x"]["a2"])
    assert s["arms"]["x"]["sets"]["A"]["geomean"] == pytest.approx(gm_a)
    assert s["arms"]["x"]["sets"]["all"]["geomean"] == pytest.approx(math.prod(means["x"].values()) ** (1 / 3))
    assert s["arms"]["c"]["sets"]["V"]["pass_geomeans"] == [pytest.approx(20), pytest.approx(30)]
    si_all = (math.prod(means["x"].values()) / math.prod(means["c"].values())) ** (1 / 3)
    assert s["speed_index"]["x"]["all"]["si"] == pytest.approx(si_all)
    assert s["speed_index"]["c"]["all"]["si"] == pytest.approx(1.0)
    assert sorted((f["arm"], f["prompt"]) for f in s["flags"]) == [("c", "v1"), ("x", "a2")]
    assert s["arms"]["c"]["prompts"]["a1"]["spread"] == pytest.approx(0.05)


def test_summarize_client_basis_and_missing_passes():
    prompts = [{"id": "a1", "set": "A"}, {"id": "a2", "set": "A"}]
    samples = [_sample("c", k, p, "A", server=100.0, client=90.0) for k in (1, 2) for p in ("a1", "a2")]
    samples += [_sample("o", 1, "a1", "A", client=45.0), _sample("o", 2, "a1", "A", client=45.0),
                _sample("o", 1, "a2", "A", ok=False), _sample("o", 2, "a2", "A", client=30.0)]
    s = summarize(samples, prompts, ["c", "o"], "c", passes=2)
    assert s["arms"]["c"]["basis"] == "server" and s["arms"]["o"]["basis"] == "client"
    assert s["speed_index"]["o"]["A"]["basis"] == "client"          # no server counter on o
    assert s["speed_index"]["o"]["A"]["si"] == pytest.approx(math.sqrt(0.5 * (30 / 90)))
    assert s["arms"]["o"]["prompts"]["a2"]["rate"] == [None, 30.0]
    assert s["arms"]["o"]["prompts"]["a2"]["errors"] == ["pass 1: boom"]
    assert len(s["errors"]) == 1


def test_geomean():
    assert geomean([2, 8]) == pytest.approx(4)
    assert geomean([None, 3]) == pytest.approx(3)
    assert geomean([]) is None

"""The arena harness end to end against stub OpenAI servers running in threads
(real HTTP on loopback, scripted token streams, delays and `timings`)."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from alphallama.bench import arena
from alphallama.bench.stub import serve_in_thread

PROMPTS = [("A1", "A"), ("A2", "A"), ("V1", "V"), ("V2", "V"), ("R1", "R"), ("R2", "R")]
TOKENS = 20
TTFT_MS = 40.0
TOKEN_MS = {"ctl": 10.0, "fast": 5.0}


def write_suite(path: Path, prompts=PROMPTS) -> Path:
    lines = [json.dumps({"id": pid, "set": pset, "category": "t", "max_tokens": TOKENS,
                         "messages": [{"role": "user", "content": f"prompt {pid}"}]})
             for pid, pset in prompts]
    path.write_text("\n".join(lines) + "\n")
    return path


def timings(n: int, ms: float, rounds: int | None = None) -> dict:
    t = {"prompt_n": 12, "prompt_ms": 4.0, "predicted_n": n, "predicted_ms": ms,
         "predicted_per_second": n / ms * 1000}
    if rounds:
        t.update(rounds=rounds, draft_n=2 * rounds, draft_n_accepted=rounds)
    return t


# Scripted server-side decode time (ms) of (pass 1, pass 2) per arm and prompt.
# ctl/V2 differs by 25% between passes (flagged); fast/A2 by 5% (not flagged).
PREDICTED_MS = {
    "ctl": {"A1": (100, 100), "A2": (125, 125), "V1": (200, 210), "V2": (100, 125),
            "R1": (50, 50), "R2": (80, 80)},
    "fast": {"A1": (50, 50), "A2": (60, 63), "V1": (100, 100), "V2": (55, 55),
             "R1": (20, 20), "R2": (25, 25)},
}
ROUNDS = {"ctl": None, "fast": 4}     # the fast arm reports rounds, like our server


def script(arm: str) -> dict:
    return {"model": f"model-{arm}", "responses": {
        f"prompt {pid}": [{"tokens": TOKENS, "ttft_ms": TTFT_MS, "token_ms": TOKEN_MS[arm],
                           "timings": timings(TOKENS, ms, ROUNDS[arm])} for ms in per_pass]
        for pid, per_pass in PREDICTED_MS[arm].items()}}


def gm(values):
    values = list(values)
    return math.prod(values) ** (1 / len(values))


@pytest.fixture(scope="module")
def two_arm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("arena")
    suite = write_suite(out / "suite.jsonl")
    with serve_in_thread(script("ctl")) as ctl, serve_in_thread(script("fast")) as fast:
        rc = arena.main(["--suite", str(suite), "--arm", f"ctl={ctl.url}", "--arm", f"fast={fast.url}/v1",
                         "--out", str(out / "res"), "--no-progress"])
        requests = {"ctl": list(ctl.requests), "fast": list(fast.requests)}
    doc = json.loads((out / "res" / "arena.json").read_text())
    return rc, doc, requests, out / "res"


def test_run_succeeds_and_records_everything(two_arm_run):
    rc, doc, requests, _ = two_arm_run
    assert rc == 0
    assert len(doc["samples"]) == 2 * 2 * len(PROMPTS)
    assert all(s["ok"] for s in doc["samples"])
    assert [a["name"] for a in doc["arms"]] == ["ctl", "fast"]
    assert doc["arms"][0]["model"] == "model-ctl"             # from /v1/models
    assert doc["arms"][0]["versions"]["props"]["build_info"] == "alphallama-stub"
    assert doc["meta"]["command"] and "git" in doc["meta"] and "gpu" in doc["meta"]
    assert doc["meta"]["versions"]["python"]
    body = requests["ctl"][0]
    assert body["model"] == "model-ctl" and body["temperature"] == 0.0 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == TOKENS


def test_second_pass_reversed_and_arms_interleaved(two_arm_run):
    _, doc, requests, _ = two_arm_run
    contents = [f"prompt {pid}" for pid, _ in PROMPTS]
    for arm in ("ctl", "fast"):
        assert [r["content"] for r in requests[arm]] == contents + contents[::-1]
    merged = sorted([(r["t"], arm, r["content"]) for arm in requests for r in requests[arm]])
    expected = ([(a, c) for c in contents for a in ("ctl", "fast")]
                + [(a, c) for c in contents[::-1] for a in ("fast", "ctl")])
    assert [(a, c) for _, a, c in merged] == expected
    assert doc["settings"]["order"] == "interleaved per prompt"


def test_decode_rate_from_server_counter(two_arm_run):
    _, doc, _, _ = two_arm_run
    for s in doc["samples"]:
        ms = PREDICTED_MS[s["arm"]][s["prompt"]][s["pass"] - 1]
        assert s["server_tps"] == pytest.approx(TOKENS / ms * 1000)
        assert s["tokens"] == TOKENS and s["token_source"] == "usage"
    fast = [s for s in doc["samples"] if s["arm"] == "fast"]
    for s in fast:
        ms = PREDICTED_MS["fast"][s["prompt"]][s["pass"] - 1]
        assert (s["rounds"], s["tokens_per_round"]) == (4, TOKENS / 4)
        assert s["ms_per_round"] == pytest.approx(ms / 4)
        assert s["acceptance"] == pytest.approx(0.5)
    assert all(s["rounds"] is None for s in doc["samples"] if s["arm"] == "ctl")


def test_client_clock_and_ttft(two_arm_run):
    _, doc, _, _ = two_arm_run
    # Scripted: first text after TTFT_MS, then one token every TOKEN_MS. The stub's sleeps
    # make the lower bounds hold under any load; a loaded 2-core CI box can delay single
    # samples by hundreds of ms, so the upper bounds are on each arm's best / median sample
    # (a harness that timed the role chunk, or the last chunk, fails them all the same).
    for arm, token_ms in TOKEN_MS.items():
        samples = [s for s in doc["samples"] if s["arm"] == arm]
        assert all(s["ttft_s"] >= TTFT_MS / 1000 for s in samples)
        assert min(s["ttft_s"] for s in samples) < TTFT_MS / 1000 + 0.05
        assert all(s["client_tps"] <= 1000 / token_ms * 1.3 for s in samples)
        rates = sorted(s["client_tps"] for s in samples)
        assert rates[len(rates) // 2] == pytest.approx(1000 / token_ms, rel=0.3)


def test_means_geomeans_speed_index_and_flags(two_arm_run):
    _, doc, _, _ = two_arm_run
    summary = doc["summary"]
    means = {arm: {pid: sum(TOKENS / ms * 1000 for ms in per) / 2 for pid, per in table.items()}
             for arm, table in PREDICTED_MS.items()}
    for arm in means:
        figs = summary["arms"][arm]
        assert figs["basis"] == "server"
        for pid, value in means[arm].items():
            assert figs["prompts"][pid]["mean"] == pytest.approx(value)
        for set_name in ("A", "V", "R"):
            expected = gm(v for pid, v in means[arm].items() if pid[0] == set_name)
            assert figs["sets"][set_name]["geomean"] == pytest.approx(expected)
            p2 = gm(TOKENS / per[1] * 1000 for pid, per in PREDICTED_MS[arm].items() if pid[0] == set_name)
            assert figs["sets"][set_name]["pass_geomeans"][1] == pytest.approx(p2)
        assert figs["sets"]["all"]["geomean"] == pytest.approx(gm(means[arm].values()))
    for set_name in ("A", "V", "R", "all"):
        pick = [pid for pid, _ in PROMPTS if set_name in ("all", pid[0])]
        si = gm(means["fast"][p] for p in pick) / gm(means["ctl"][p] for p in pick)
        assert summary["speed_index"]["fast"][set_name]["si"] == pytest.approx(si)
        assert summary["speed_index"]["ctl"][set_name]["si"] == pytest.approx(1.0)
    assert [(f["arm"], f["prompt"]) for f in summary["flags"]] == [("ctl", "V2")]
    assert summary["arms"]["ctl"]["prompts"]["V2"]["spread"] == pytest.approx(0.25)
    assert summary["arms"]["fast"]["prompts"]["A2"]["spread"] == pytest.approx(0.05)
    # tok/s = tokens per round / ms per round, per set, for the arm that reports rounds
    # (exact for sets whose passes agree; A2's 5% spread makes "all" approximate)
    fast = summary["arms"]["fast"]["sets"]
    assert 1000 * fast["R"]["tokens_per_round"] / fast["R"]["ms_per_round"] == pytest.approx(fast["R"]["geomean"])
    assert 1000 * fast["all"]["tokens_per_round"] / fast["all"]["ms_per_round"] == pytest.approx(
        fast["all"]["geomean"], rel=1e-3)


def test_outputs_contain_the_figures(two_arm_run):
    _, doc, _, res = two_arm_run
    md = (res / "report.md").read_text()
    summary = doc["summary"]
    assert f"{summary['arms']['fast']['sets']['all']['geomean']:.1f}" in md
    assert f"{summary['speed_index']['fast']['R']['si']:.3f}" in md
    assert "| V2 | V | ctl |" in md and "⚠" in md and "## Disagreeing passes" in md
    assert "Per set" in md and "Per prompt" in md
    for name in ("plot-sets.png", "plot-ratios.png", "plot-rounds.png"):
        data = (res / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        assert f"]({name})" in md


def test_server_without_timings_uses_client_clock(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl", PROMPTS[:2])
    plain = {"default": {"tokens": TOKENS, "ttft_ms": 5, "token_ms": 4.0, "timings": None}}
    ctl = {"default": {"tokens": TOKENS, "ttft_ms": 5, "token_ms": 8.0, "timings": timings(TOKENS, 50.0)}}
    with serve_in_thread(ctl) as a, serve_in_thread(plain) as b:
        rc = arena.main(["--suite", str(suite), "--arm", f"ctl={a.url}", "--arm", f"plain={b.url}",
                         "--out", str(tmp_path / "r"), "--no-progress", "--no-plots", "--no-usage",
                         "--warmup", "1"])
        assert b.requests[0]["stream_options"] is None
        # one untimed warm-up per pass, with the pass's first prompt
        assert [r["content"][-2:] for r in b.requests] == ["A1", "A1", "A2", "A2", "A2", "A1"]
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    assert rc == 0 and len(doc["samples"]) == 8
    plain_samples = [s for s in doc["samples"] if s["arm"] == "plain"]
    assert all(s["server_tps"] is None and s["token_source"] == "chunks" for s in plain_samples)
    assert doc["summary"]["arms"]["plain"]["basis"] == "client"
    si = doc["summary"]["speed_index"]["plain"]["all"]
    assert si["basis"] == "client" and si["si"] == pytest.approx(2.0, rel=0.3)   # 4 ms vs 8 ms a token


def test_server_dying_mid_run_is_reported_not_hung(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl", PROMPTS[:4])
    ok = {"default": {"tokens": TOKENS, "ttft_ms": 2, "token_ms": 1}}
    dies = {"default": {"tokens": TOKENS, "ttft_ms": 2, "token_ms": 1},
            "responses": {"prompt A2": [{"tokens": TOKENS, "fail": "exit", "fail_after": 3}]}}
    t0 = time.monotonic()
    with serve_in_thread(ok) as a, serve_in_thread(dies) as b:
        rc = arena.main(["--suite", str(suite), "--arm", f"ok={a.url}", "--arm", f"dies={b.url}",
                         "--out", str(tmp_path / "r"), "--no-progress", "--timeout", "20"])
    assert time.monotonic() - t0 < 15          # nowhere near a timeout per request
    assert rc == 1
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    dead = {(s["pass"], s["prompt"]): s for s in doc["samples"] if s["arm"] == "dies"}
    assert dead[(1, "A1")]["ok"]
    assert not dead[(1, "A2")]["ok"] and "skipped" not in dead[(1, "A2")]["error"]
    later = [s for key, s in dead.items() if key not in {(1, "A1"), (1, "A2")}]
    assert len(later) == 6 and all(s["error"].startswith("skipped: server stopped answering") for s in later)
    assert all(s["ok"] for s in doc["samples"] if s["arm"] == "ok")
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Errors" in md and "dies pass 1 A2" in md


def test_hung_stream_times_out_and_run_continues(tmp_path):
    suite = write_suite(tmp_path / "s.jsonl", PROMPTS[:2])
    hangs = {"default": {"tokens": 4, "ttft_ms": 2, "token_ms": 1},
             "responses": {"prompt A1": [{"fail": "hang", "fail_after": 2}, {"fail": "http500"}]}}
    with serve_in_thread(hangs) as a:
        rc = arena.main(["--suite", str(suite), "--arm", f"h={a.url}", "--out", str(tmp_path / "r"),
                         "--no-progress", "--no-plots", "--timeout", "0.5"])
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    by = {(s["pass"], s["prompt"]): s for s in doc["samples"]}
    assert rc == 1
    assert by[(1, "A1")]["error"].startswith("timeout")
    assert by[(2, "A1")]["error"].startswith("HTTP 500")
    assert by[(1, "A2")]["ok"] and by[(2, "A2")]["ok"]     # the server still answered: keep going


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert arena.main(["--arm", "x=llama-server -m M", "--out", str(tmp_path)]) == 2
    assert "{port}" in capsys.readouterr().err
    assert arena.main(["--arm", "x=http://h:1", "--control", "y", "--out", str(tmp_path)]) == 2
    assert arena.main(["--arm", "x=http://h:1", "--prompts", "Z9", "--out", str(tmp_path)]) == 2

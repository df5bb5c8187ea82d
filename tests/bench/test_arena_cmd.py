"""Command arms: the harness starts a fresh stub server (a real subprocess) per arm and
pass on a free port, waits for /health, stops it after, and survives a server that
crashes mid-stream."""
from __future__ import annotations

import json
import shlex
import socket
import sys
import time
from pathlib import Path

from alphallama.bench import arena

PROMPTS = [("A1", "A"), ("V1", "V"), ("R1", "R")]


def write_suite(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": pid, "set": pset, "max_tokens": 6,
                                        "messages": [{"role": "user", "content": f"prompt {pid}"}]}) + "\n"
                            for pid, pset in PROMPTS))
    return path


def stub_cmd(tmp: Path, name: str, script: dict) -> str:
    (tmp / f"{name}.json").write_text(json.dumps(script))
    return (f"{shlex.quote(sys.executable)} -m alphallama.bench.stub --port {{port}} "
            f"--script {tmp / f'{name}.json'} --log {tmp / f'{name}.log'}")


def requests_of(tmp: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / f"{name}.log").read_text().splitlines()]


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_fresh_server_per_arm_and_pass(tmp_path):
    suite = write_suite(tmp_path / "suite.jsonl")
    slow_start = {"startup_delay_s": 0.3, "default": {"tokens": 6, "ttft_ms": 2, "token_ms": 1}}
    rc = arena.main(["--suite", str(suite), "--arm", "a=" + stub_cmd(tmp_path, "a", slow_start),
                     "--arm", "b=" + stub_cmd(tmp_path, "b", slow_start), "--out", str(tmp_path / "r"),
                     "--no-progress", "--no-plots"])
    assert rc == 0
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    assert doc["settings"]["order"] == "block per arm and pass"
    servers = doc["servers"]
    # pass 1: a then b; pass 2: b then a -- one server alive at a time
    assert [(s["arm"], s["pass"]) for s in servers] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    for prev, nxt in zip(servers, servers[1:]):
        assert prev["stopped_at"] <= nxt["started_at"]
    for s in servers:
        assert s["startup_s"] >= 0.3                 # waited out the 503s of /health
        assert s["returncode"] == -15 and not s["exited_during_run"]   # stopped by SIGTERM
        assert refused(s["port"])
        assert Path(s["log"]).exists()
    assert len({s["port"] for s in servers}) >= 2
    contents = [f"prompt {pid}" for pid, _ in PROMPTS]
    for arm in ("a", "b"):
        assert [r["content"] for r in requests_of(tmp_path, arm)] == contents + contents[::-1]
    merged = sorted((r["t"], arm) for arm in ("a", "b") for r in requests_of(tmp_path, arm))
    assert [arm for _, arm in merged] == ["a"] * 3 + ["b"] * 6 + ["a"] * 3
    assert all(s["ok"] for s in doc["samples"])


def test_server_crash_mid_stream(tmp_path):
    suite = write_suite(tmp_path / "suite.jsonl")
    crash = {"default": {"tokens": 6, "ttft_ms": 2, "token_ms": 1},
             "responses": {"prompt V1": [{"tokens": 6, "fail": "exit", "fail_after": 2}]}}
    t0 = time.monotonic()
    rc = arena.main(["--suite", str(suite), "--arm", "c=" + stub_cmd(tmp_path, "c", crash),
                     "--out", str(tmp_path / "r"), "--no-progress", "--no-plots", "--timeout", "30"])
    assert time.monotonic() - t0 < 20
    assert rc == 1
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    result = [(s["pass"], s["prompt"], s["ok"], (s["error"] or "")[:8]) for s in doc["samples"]]
    # Pass 1: A1 ok, V1 cut mid-stream, R1 skipped (process gone). Pass 2 gets a fresh
    # server: R1 ok, V1 crashes it again, A1 skipped.
    assert [r[:3] for r in result] == [(1, "A1", True), (1, "V1", False), (1, "R1", False),
                                       (2, "R1", True), (2, "V1", False), (2, "A1", False)]
    assert result[2][3] == result[5][3] == "skipped:"
    assert "exited with code 3" in doc["samples"][2]["error"]
    assert [s["exited_during_run"] for s in doc["servers"]] == [True, True]
    assert [s["returncode"] for s in doc["servers"]] == [3, 3]
    assert doc["summary"]["arms"]["c"]["prompts"]["A1"]["rate"][1] is None
    assert "c pass 1 V1" in (tmp_path / "r" / "report.md").read_text()


def test_server_that_never_gets_healthy(tmp_path):
    suite = write_suite(tmp_path / "suite.jsonl")
    broken = f"{shlex.quote(sys.executable)} -c 'raise SystemExit(5)' {{port}}"
    never = {"startup_delay_s": 60}
    ok = {"default": {"tokens": 6, "ttft_ms": 2, "token_ms": 1}}
    rc = arena.main(["--suite", str(suite), "--arm", "ok=" + stub_cmd(tmp_path, "ok", ok),
                     "--arm", "broken=" + broken, "--arm", "slow=" + stub_cmd(tmp_path, "slow", never),
                     "--out", str(tmp_path / "r"), "--no-progress", "--no-plots", "--startup-timeout", "1"])
    assert rc == 1
    doc = json.loads((tmp_path / "r" / "arena.json").read_text())
    by_arm = {}
    for s in doc["samples"]:
        by_arm.setdefault(s["arm"], []).append(s)
    assert all(s["ok"] for s in by_arm["ok"])
    assert all(s["error"].startswith("skipped: server did not start: server exited with code 5")
               for s in by_arm["broken"])
    assert all("not healthy after 1s" in s["error"] for s in by_arm["slow"])
    for s in doc["servers"]:
        if s["arm"] != "ok":
            assert "error" in s
        if "port" in s:
            assert refused(s["port"])

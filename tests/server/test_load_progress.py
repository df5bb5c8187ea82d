"""What run and serve show while loading: each stage with its time, a bar on a terminal,
and /health 200 only once the warm-up is over."""
from __future__ import annotations

import io
import re
import subprocess
import sys


from alphallama.load_progress import LoadProgress

from serverutil import free_port, wait_healthy

CLI = [sys.executable, "-m", "alphallama.cli"]
STAGES = ("reading the weights of", "building the KV cache", "warming up")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_are_lines_with_times_off_a_terminal(stories_path):
    out = io.StringIO()
    p = LoadProgress(str(stories_path), out)
    p.weights()
    p.update("tok_embeddings.weight", 1000)
    p.begin("building")
    p.end()
    p.end()                               # a second end: nothing more
    lines = out.getvalue().splitlines()
    size = stories_path.stat().st_size / 2**20
    assert lines[0] == f"alphallama: reading the weights of {stories_path.name} ({size:,.0f} MiB) ..."
    assert re.fullmatch(r"alphallama: reading the weights of .*: \d+\.\d s", lines[1])
    assert lines[2] == "alphallama: building ..." and re.fullmatch(r"alphallama: building: \d+\.\d s", lines[3])
    assert len(lines) == 4


def test_a_terminal_gets_a_bar_for_the_weights(stories_path):
    out = Terminal()
    p = LoadProgress(str(stories_path), out)
    p.weights()
    p.update("x", stories_path.stat().st_size)
    p.end()
    text = out.getvalue()
    assert f"\rloading {stories_path.name}:" in text and "B/s]" in text     # tqdm's bar (then cleared)
    assert re.search(r"alphallama: reading the weights of .*: \d+\.\d s\n$", text)


def test_serve_is_healthy_only_after_the_warmup(stories_path, tmp_path):
    log = tmp_path / "stderr.txt"
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen([*CLI, "serve", "-m", str(stories_path), "--port", str(port), "--spec-type", "ngram"],
                                stderr=err, text=True)
    try:
        wait_healthy(proc, port, 90, log.read_text)
        text = log.read_text()             # everything before 200 was flushed before the worker said ready
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ends = [text.find(f"alphallama: {s}") for s in STAGES] + [text.find("; ready")]
    assert -1 not in ends and ends == sorted(ends), text
    assert re.search(r"alphallama: warming up [^\n]*: \d+\.\d s\n", text), text


def test_run_with_no_warmup_skips_it(stories_path):
    proc = subprocess.run([*CLI, "run", "-m", str(stories_path), "-p", "Once", "-n", "3", "--no-warmup"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--no-warmup: " in proc.stderr and "warming up" not in proc.stderr
    assert "reading the weights of" in proc.stderr and "building the KV cache" in proc.stderr


def test_a_failed_stage_clears_its_bar_and_prints_no_time(stories_path):
    out = Terminal()
    p = LoadProgress(str(stories_path), out)
    p.weights()
    p.abandon()
    p.end()
    assert "alphallama:" not in out.getvalue()
    assert LoadProgress("/no/such/model.gguf", io.StringIO()).size is None   # Engine.load reports it, not us

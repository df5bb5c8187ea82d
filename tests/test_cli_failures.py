"""Clean failures, as a user meets them in a shell: one clear line on stderr and a
non-zero exit; never a traceback, and never a URL or 'ready' line before the exit."""
from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
import torch

CLI = [sys.executable, "-m", "alphallama"]   # __main__.py: what the device scripts call
RAISES = "{{ raise_exception('this model takes no user turns') }}"
BAD_TYPES = "{{ messages[0]['content'] + 1 }}"   # str + int: fails while rendering, not parsing


def cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout)


def assert_clean(proc: subprocess.CompletedProcess, *says: str) -> None:
    err = proc.stderr
    assert proc.returncode != 0, err
    assert "Traceback" not in err and "http://" not in err and not re.search(r"\bready\b", err), err
    last = err.strip().splitlines()[-1]
    assert "error" in last and all(s in last for s in says), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["serve", "--port", "0"]])
def test_device_cuda_without_a_gpu(command, stories_path):
    proc = cli(*command, "-m", str(stories_path), "--device", "cuda")
    assert_clean(proc, "no CUDA GPU")
    assert proc.returncode == 2 and "reading the weights" not in proc.stderr


def test_serve_on_a_port_in_use(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = cli("serve", "-m", str(stories_path), "--host", "127.0.0.1", "--port", str(port), timeout=60)
    assert_clean(proc, f"127.0.0.1:{port}", "in use", "--port")
    assert proc.returncode == 2 and "reading the weights" not in proc.stderr   # stopped before loading


@pytest.mark.parametrize("template, says", [(RAISES, "this model takes no user turns"), (BAD_TYPES, "template")])
def test_run_chat_with_a_template_that_fails(template, says, stories_path, tmp_path):
    model = tmp_path / "templated.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(stories_path), str(model),
                    "--chat-template", template, "--force"], check=True, capture_output=True, timeout=60)
    proc = cli("run", "-m", str(model), "-p", "hi", "--chat", "-n", "2")
    assert_clean(proc, says)
    assert proc.returncode == 2 and proc.stdout == ""


def test_inspect_into_a_closed_pipe(stories_path):
    proc = subprocess.Popen([*CLI, "inspect", "-m", str(stories_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                    # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == ""     # as a shell's writer killed by SIGPIPE: quiet


def test_inspect_piped_into_head(stories_path):
    cmd = " ".join([*CLI, "inspect", "-m", str(stories_path)]) + " | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"{stories_path}: ") and proc.stdout.count("\n") == 1

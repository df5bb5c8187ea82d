"""`alphallama-serve` / `alphallama serve` as a user runs it: a subprocess on a free port."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys

from openai import OpenAI

from alphallama.tokenizer import Tokenizer

from serverutil import free_port, wait_healthy

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def serve_command() -> list[str]:
    exe = shutil.which("alphallama-serve")
    return [exe] if exe else [sys.executable, "-m", "alphallama.cli", "serve"]


def test_serve_cli_end_to_end(stories_path, tmp_path):
    template = tmp_path / "qa.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    cmd = serve_command() + ["-m", str(stories_path), "--port", str(port), "--api-key", "k", "--alias", "story",
                             "-n", "6", "--chat-template-file", str(template), "--spec-type", "ngram"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 60, proc.stderr.read)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model="story", messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"   # -n 6
        tok = Tokenizer.from_gguf(stories_path)   # the template file was used, not ChatML
        assert r.usage.prompt_tokens == len(tok.encode("user: hi\nassistant:", add_special=True))
        assert "draft_n" in r.model_extra["timings"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130) and "Traceback" not in err, err   # 130: ended by Ctrl-C, cleanly
    assert f"http://127.0.0.1:{port}/v1" in err and "loaded" in err and "'story'" in err


def test_serve_cli_reports_a_model_it_cannot_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    proc = subprocess.run(serve_command() + ["-m", str(bad), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "could not load" in proc.stderr and "Traceback" not in proc.stderr

"""The chat page at / in headless Chromium (Debian's /usr/bin/chromium, driven by the
playwright package: `pip install -e '.[browser]'`) against `alphallama serve` on the
embedded model, as a user meets it: the API key asked for, the model and mode shown, a
prompt typed, the answer streamed with its decode counter, a follow-up that carries the
history, and Stop. Screenshots go to $ALPHA_SCREENSHOTS when set (docs/screenshots/
holds the committed ones)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serverutil import free_port, wait_healthy

CHROMIUM = Path("/usr/bin/chromium")
KEY = "page-key"
# What the project's probe found Chromium needs here: no sandbox as root, no GPU, and no
# background connections (this machine's closed network refuses them).
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not present (Debian: apt-get install chromium)")
    playwright = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed "
                                     "(pip install -e '.[browser]')")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    port = free_port()
    cmd = [sys.executable, "-m", "alphallama.cli", "serve", "--port", str(port), "--api-key", KEY, "-t", "1",
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 300, lambda: proc.stderr.read())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def shot(page, name: str) -> None:
    where = os.environ.get("ALPHA_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(where) / name))


def slot_busy(base: str) -> bool:
    r = httpx.get(base + "/slots", headers={"Authorization": f"Bearer {KEY}"})
    return r.json()[0]["is_processing"]


def test_chat_page_streams_keeps_history_and_stops(browser, server):
    page = browser.new_page(viewport={"width": 1000, "height": 720})
    sent: list[dict] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    page.goto(server + "/")
    # (locators, not wait_for_function: the page's CSP forbids the string eval that one needs)
    page.locator("#model", has_text="API key").wait_for()
    page.fill("#key", KEY)
    page.press("#key", "Enter")
    page.locator("#model", has_text="alphallama-embedded").wait_for()
    assert "speculation" in page.text_content("#mode") and "exact" in page.text_content("#mode")
    assert "cpu" in page.text_content("#mode")

    # a prompt, its streamed answer and the decode counter under it
    page.fill("#max-tokens", "64")
    page.fill("#prompt", "Write a Python function that returns the sum of two numbers.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant.done", timeout=120_000)
    answer = page.text_content(".msg.assistant .bubble")
    stats = page.text_content(".msg.assistant .stats")
    assert answer.strip(), "no answer was streamed"
    assert "tok/s" in stats and "tokens/round" in stats and "tokens" in stats, stats
    n = int(stats.split(" tokens")[0])
    assert 1 <= n <= 64
    assert sent[0]["stream"] is True and sent[0]["messages"] == [
        {"role": "user", "content": "Write a Python function that returns the sum of two numbers."}]
    shot(page, "chat-answer.png")

    # a follow-up carries the conversation
    page.fill("#prompt", "Now make it return the product instead.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant.done >> nth=1", timeout=120_000)
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][1]["content"] == answer
    assert page.locator(".msg").count() == 4

    # Stop: the stream ends at once, the answer is marked, the server's slot is freed
    page.click("#new")
    assert page.locator(".msg").count() == 0
    page.fill("#max-tokens", "900")
    page.fill("#temperature", "1.0")   # sampled: a long answer, not an early end of turn
    page.fill("#prompt", "Write a long Python module with many functions and classes.")
    page.press("#prompt", "Enter")
    page.locator(".msg.assistant .bubble", has_text=re.compile(r"\S")).wait_for(timeout=120_000)
    assert page.is_visible("#stop") and not page.is_visible("#send")
    shot(page, "chat-streaming.png")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant.stopped", timeout=10_000)
    assert page.text_content(".msg.assistant .stats").startswith("stopped after ")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    shot(page, "chat-stopped.png")
    deadline = time.monotonic() + 10
    while slot_busy(server):
        assert time.monotonic() < deadline, "Stop did not cancel the generation on the server"
        time.sleep(0.05)

    # the conversation survives a reload (the page keeps it), without the stopped turn lost
    page.reload()
    page.locator("#model", has_text="alphallama-embedded").wait_for()
    assert page.locator(".msg").count() == 2
    page.close()



def test_a_thinking_models_reasoning_is_folded_above_its_answer(browser, tmp_path):
    """A template that opens <think> in the generation prompt (server/reasoning.py): the
    page shows the streamed reasoning_content in the folded "thinking" block, apart from
    the answer, and keeps it across a reload."""
    from test_reasoning import THINKING_TEMPLATE
    tmpl = tmp_path / "thinking.jinja"
    tmpl.write_text(THINKING_TEMPLATE)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "alphallama.cli", "serve", "--port", str(port), "-t", "1",
                             "--device", "cpu", "--chat-template-file", str(tmpl)], stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, port, 300, lambda: proc.stderr.read())
        page = browser.new_page(viewport={"width": 1000, "height": 600})
        page.goto(f"http://127.0.0.1:{port}/")
        page.locator("#model", has_text="alphallama-embedded").wait_for()
        page.fill("#max-tokens", "16")
        page.fill("#prompt", "Write a function that adds two numbers.")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant.done", timeout=120_000)
        assert page.is_visible(".msg.assistant .thinking")
        assert page.text_content(".msg.assistant .thinking div").strip()   # 16 tokens, no </think>: all reasoning
        assert page.text_content(".msg.assistant .bubble") == ""
        page.click(".msg.assistant .thinking summary")
        shot(page, "chat-thinking.png")
        page.reload()
        page.locator("#model", has_text="alphallama-embedded").wait_for()
        assert page.is_visible(".msg.assistant .thinking")
        page.close()
    finally:
        proc.terminate()
        proc.wait(30)

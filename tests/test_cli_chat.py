"""`run -cnv`: each turn's reply is what a fresh engine generates for the conversation so
far (the loop's prefix re-use changes nothing), with -p as the system message."""
from __future__ import annotations

import io

import pytest

from alphallama.cli_chat import chat_loop
from alphallama.engine import Engine
from alphallama.sampling import SamplingParams
from alphallama.spec.config import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0.0)


def test_each_turn_matches_a_fresh_engine(stories_path):
    engine = Engine.load(str(stories_path), ctx_size=512, device="cpu")
    out = io.StringIO()
    turns = ["Once upon a time", "", "And then?"]         # the blank line is no turn
    assert chat_loop(engine, SpecConfig("none"), GREEDY, 10, "Tell stories.", io.StringIO("\n".join(turns) + "\n"),
                     out) == 0
    replies = out.getvalue().split("\n")[:-1]
    assert len(replies) == 2
    messages = [{"role": "system", "content": "Tell stories."}]
    for user, reply in zip(["Once upon a time", "And then?"], replies):
        messages.append({"role": "user", "content": user})
        fresh = Engine.load(str(stories_path), ctx_size=512, device="cpu")
        ids = fresh.encode_chat(messages)
        want = fresh.tokenizer.decode(list(fresh.generate(ids, 10, GREEDY)), continuation=True)
        assert reply == want
        messages.append({"role": "assistant", "content": want})
    assert engine.cached[:len(ids)] == ids                  # the last turn ran on top of the earlier ones


def test_a_conversation_that_outgrows_the_context_ends_cleanly(stories_path, capsys):
    engine = Engine.load(str(stories_path), ctx_size=48, device="cpu")
    rc = chat_loop(engine, SpecConfig("none"), GREEDY, 40, None, io.StringIO("hello\n" * 10), io.StringIO())
    assert rc == 2 and "context" in capsys.readouterr().err

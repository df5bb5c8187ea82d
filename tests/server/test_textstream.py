"""Stop strings and incremental detokenization on hand-built pieces."""
from __future__ import annotations

import pytest

from alphallama.server.textstream import StopStrings, TextStream
from alphallama.tokenizer import Detokenizer


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    s = StopStrings(stops)
    out = [s.push(p) for p in pieces]
    if not s.stopped:
        out.append(s.flush())
    return out, s.stopped


def test_no_stops_passes_everything_through():
    out, stopped = run(["Hel", "lo", " world"], [])
    assert out == ["Hel", "lo", " world", ""] and not stopped


def test_stop_inside_one_piece_cuts_before_it():
    out, stopped = run(["Hello. World"], ["."])
    assert out == ["Hello"] and stopped


def test_stop_spanning_pieces_is_held_back_then_dropped():
    # "\n\n" arrives one "\n" at a time: the first must not be sent before we know.
    out, stopped = run(["one", "\n", "\n", "two"], ["\n\n"])
    assert out == ["one", "", "", ""] and stopped   # nothing after the stop either


def test_held_prefix_released_when_it_turns_out_not_to_be_a_stop():
    out, stopped = run(["ab", "c", "X", "d"], ["cd"])
    assert "".join(out) == "abcXd" and not stopped
    assert out[1] == ""                  # "c" was held: it could have started "cd"
    assert out[2] == "cX"                # ... released once "X" ruled that out


def test_held_tail_is_released_at_the_end():
    out, stopped = run(["the en"], ["end."])
    assert out == ["the ", "en"] and not stopped


def test_earliest_of_several_stops_wins():
    out, stopped = run(["xx", "BA", "yy"], ["AY", "B"])
    assert "".join(out) == "xx" and stopped
    out, stopped = run(["a long stop and a short"], ["long stop", "short"])
    assert out == ["a "] and stopped


def test_overlapping_prefixes_keep_the_longest_partial_match():
    # "aab" must be found although "a" then "a" first looked like a restart.
    out, stopped = run(["a", "a", "a", "b", "c"], ["aab"])
    assert "".join(out) == "a" and stopped


def test_stop_at_the_very_start_emits_nothing():
    out, stopped = run(["STOP here"], ["STOP"])
    assert out == [""] and stopped


def test_nothing_after_a_stop():
    s = StopStrings(["x"])
    assert s.push("ax") == "a"
    assert s.push("more") == "" and s.flush() == ""


def test_empty_and_duplicate_stops_are_ignored():
    assert StopStrings(["", "a", "a"]).stops == ["a"]


# -- with a detokenizer ----------------------------------------------------------------

class _Tok:
    """Four hand-built tokens: é is split across two of them."""
    pieces = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        return self.pieces[token_id]


def test_split_utf8_character_is_never_half_sent():
    ts = TextStream(Detokenizer(_Tok()), stops=[])
    assert [ts.feed(t) for t in (0, 1, 2, 3)] == ["caf", "", "é", "!"]
    assert ts.finish() == ""


def test_stop_string_made_of_a_split_character():
    ts = TextStream(Detokenizer(_Tok()), stops=["é!"])
    assert [ts.feed(t) for t in (0, 1, 2)] == ["caf", "", ""]
    assert ts.feed(3) == "" and ts.stopped


def test_unfinished_character_at_the_end_becomes_replacement_char():
    ts = TextStream(Detokenizer(_Tok()), stops=["zz"])
    assert ts.feed(0) == "caf" and ts.feed(1) == ""
    assert ts.finish() == "\ufffd"


@pytest.mark.parametrize("stops", [["\ufffd"], ["f\ufffd"]])
def test_replacement_char_from_the_flush_can_complete_a_stop(stops):
    ts = TextStream(Detokenizer(_Tok()), stops=stops)
    sent = ts.feed(0) + ts.feed(1)
    assert sent + ts.finish() in ("caf", "ca") and ts.stopped

"""bench/gpu_np_servers.py's pure pieces: the batch figures from per-stream chunk times,
and the ratios ours / llama-server."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from gpu_np_servers import aggregate, ratios, texts_possible  # noqa: E402


def _stream(t_sent, times, tokens, ok=True):
    first, last = times[0], times[-1]
    return {"ok": ok, "tokens": tokens, "t_sent": t_sent, "e2e_s": last - t_sent + 0.01, "times": times,
            "ttft_s": first - t_sent, "decode_tok_s": (tokens - 1) / (last - first)}


def test_one_stream_window_is_its_decode_rate():
    s = _stream(0.0, [0.5 + 0.1 * i for i in range(11)], 11)
    a = aggregate([s])
    assert a["window_s"] == pytest.approx(1.0)
    assert a["window_tok_s"] == pytest.approx(10.0) == pytest.approx(s["decode_tok_s"])
    assert a["total_tok_s"] == pytest.approx(11 / 1.51)
    assert a["mean_ttft_s"] == pytest.approx(0.5)


def test_window_is_where_all_streams_decode_and_chunks_weigh_tokens():
    a = _stream(0.0, [0.1 * i for i in range(1, 21)], 20)          # 0.1 .. 2.0, one token a chunk
    b = _stream(0.0, [1.0 + 0.2 * i for i in range(10)], 20)       # 1.0 .. 2.8, two tokens a chunk
    agg = aggregate([a, b])
    # window (1.0, 2.0]: a's chunks 1.1..2.0 (10 tokens), b's 1.2..2.0 (5 chunks, 10 tokens)
    assert agg["window_s"] == pytest.approx(1.0)
    assert agg["window_tok_s"] == pytest.approx(20.0)
    assert agg["tokens"] == 40 and agg["streams_ok"] == 2
    assert agg["wall_s"] == pytest.approx(2.81)
    assert agg["max_ttft_s"] == pytest.approx(1.0)


def test_no_window_when_a_stream_failed_or_streams_do_not_overlap():
    a = _stream(0.0, [0.1, 0.2, 0.3], 3)
    failed = {"ok": False, "tokens": None, "t_sent": 0.0, "e2e_s": 0.05, "times": []}
    assert aggregate([a, failed])["window_tok_s"] is None
    later = _stream(0.0, [0.5, 0.6], 2)
    assert aggregate([a, later])["window_tok_s"] is None


def test_ratios():
    ours = {"aggregate": {"total_tok_s": 300.0, "window_tok_s": None, "per_stream_decode_tok_s": 100.0,
                          "mean_ttft_s": 0.05}}
    theirs = {"aggregate": {"total_tok_s": 200.0, "window_tok_s": 210.0, "per_stream_decode_tok_s": 80.0,
                            "mean_ttft_s": 0.1}}
    assert ratios(ours, theirs) == {"total_tok_s": 1.5, "window_tok_s": None, "per_stream_decode_tok_s": 1.25,
                                    "mean_ttft_s": 0.5}
    assert ratios(ours, None)["total_tok_s"] is None


def test_client_counts_completion_text_chunks():
    from alphallama.bench.client import _StreamState
    from alphallama.bench.sse import Event
    heard = []
    s = _StreamState(on_chunk=heard.append)
    s.on_event(Event("message", '{"choices": [{"text": "ab", "index": 0, "finish_reason": null}]}'), 1.0)
    s.on_event(Event("message", '{"choices": [{"text": "", "finish_reason": "length"}], '
                                '"usage": {"completion_tokens": 2}}'), 2.0)
    s.on_event(Event("message", "[DONE]"), 2.5)
    assert (s.chunks, s.chars, heard, s.finish_reason, s.done) == (1, 2, [1.0], "length", True)


def test_a_padded_byte_vocabulary_is_refused_before_any_server_starts(tmp_path):
    """The synthetic default vocabulary (258 tokens + UNUSED padding) streams no text: refused
    with the way out; the same shape with a real vocabulary passes."""
    from dataclasses import replace

    from alphallama.gguf.writer import PRESETS, write_synthetic
    spec = replace(PRESETS["tiny-qwen3"](), vocab_size=4096)
    write_synthetic(spec, tmp_path / "padded.gguf")
    why = texts_possible(str(tmp_path / "padded.gguf"))
    assert why is not None and "257 of 4096" in why and "--vocab-from" in why
    embedded = ROOT / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"
    write_synthetic(replace(spec, vocab_from=str(embedded)), tmp_path / "real.gguf")
    assert texts_possible(str(tmp_path / "real.gguf")) is None

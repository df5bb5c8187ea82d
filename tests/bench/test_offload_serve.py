"""bench/gpu_offload_serve.py's pure pieces: the expert store's figures over the timed
requests from two /metrics scrapes, and the means over the requests."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT

from alphallama.server.metrics import Metrics

sys.path.insert(0, str(ROOT / "bench"))
import gpu_offload_serve  # noqa: E402
from gpu_offload_serve import round_parts, scrape, store_delta, summarize  # noqa: E402


def _samples(store: dict | None) -> dict[str, float]:
    text = Metrics().render(0, 0, True, store)
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if not ln.startswith("#"))}


def test_store_delta_is_the_timed_requests_own():
    fig = {"lookups": 100, "hits": 60, "admissions": 2, "admitted_bytes": 10, "bank_bytes": 7, "host_bytes": 9,
           "mapped_bytes": 0, "cpu_share": 0.5}
    later = fig | {"lookups": 300, "hits": 210, "admissions": 5, "cpu_share": 0.25}
    d = store_delta(_samples(fig), _samples(later))
    assert (d["lookups"], d["hits"], d["admissions"]) == (200, 150, 3)
    assert d["hit_rate"] == pytest.approx(0.75)
    assert d["cpu_share"] == 0.25 and d["tier_bytes"] == {"bank": 7, "host": 9, "mapped": 0}


def test_round_parts_are_the_clock_over_the_rounds():
    clock = {"posts": 10, "busy_ns": 2_000_000, "gap_ns": 500_000, "gaps": 8, "pairs": 40, "groups": 30}
    fig = {"lookups": 1, "hits": 1, "admissions": 0, "admitted_bytes": 0, "bank_bytes": 1, "host_bytes": 1,
           "mapped_bytes": 0, "cpu_share": 0.5, "cpu_clock": clock}
    later = fig | {"cpu_clock": {k: 3 * v for k, v in clock.items()}}
    p = round_parts(store_delta(_samples(fig), _samples(later)), rounds=4)
    assert p == pytest.approx({"posts": 5.0, "pairs": 20.0, "groups": 15.0, "busy_ms": 1.0, "gap_ms": 0.25, "gaps": 4.0})
    assert round_parts(store_delta(_samples(None), _samples(None)), rounds=4) is None


def test_no_store_no_figures():
    d = store_delta(_samples(None), _samples(None))
    assert d["lookups"] is None and d["hit_rate"] is None and d["cpu_share"] is None


def test_summarize_means_and_totals():
    reqs = [{"ok": True, "tokens": 10, "client_tps": 100.0, "ms_per_round": 2.0, "ttft_s": None},
            {"ok": True, "tokens": 12, "client_tps": 200.0, "ms_per_round": 4.0, "ttft_s": 0.1}]
    s = summarize(reqs)
    assert s["client_tps"] == 150.0 and s["ms_per_round"] == 3.0 and s["ttft_s"] == 0.1
    assert s["tokens"] == 22 and s["ok"] and s["server_tps_reported"] is None


def test_scrape_reads_ours_and_tolerates_a_server_without_metrics(monkeypatch):
    """llama-server answers /metrics with 501 and a JSON error unless started with --metrics:
    that arm has no figures, it does not stop the run (session 51's call stopped there)."""
    import httpx
    ours = Metrics().render(0, 0, True, None)
    answers = {"ours": httpx.Response(200, text=ours + "odd_line not_a_number\n"),
               "llama": httpx.Response(501, text='{"error":{"message":"This server does not support metrics '
                                                 'endpoint. Start it with `--metrics`"}}')}
    monkeypatch.setattr(gpu_offload_serve.httpx, "get", lambda url, timeout: answers[url.split("/")[2]])
    got = scrape("http://ours")
    assert got and got == _samples(None)
    assert scrape("http://llama") == {}

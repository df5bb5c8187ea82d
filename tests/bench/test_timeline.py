"""The kernel timeline's summary (alphallama/bench/timeline.py): the union of overlapping
kernels, the idle time between them and the per-kind sums a round, against sums done by
hand; the chrome-trace reader; the profiler wrapper runs where there is no GPU."""
from __future__ import annotations

import pytest
import torch

from alphallama.bench.timeline import Kernel, busy_us, kernel_trace, kernels_of_chrome_trace, kind_of, summarize


def test_busy_is_the_union_of_intervals():
    ks = [Kernel("a", 0, 10), Kernel("b", 5, 10), Kernel("c", 30, 5), Kernel("d", 31, 1)]   # [0,15) [30,35)
    assert busy_us(ks) == 20.0
    assert busy_us(list(reversed(ks))) == 20.0
    assert busy_us([]) == 0.0


def test_summary_per_round_by_kind():
    ks = [Kernel("q8_post_kernel", 0, 2), Kernel("moe_i8_gate_up_kernel", 2, 8),
          Kernel("q8_combine_kernel", 10, 30), Kernel("triton_attn_decode", 50, 10),
          Kernel("q8_post_kernel", 100, 2), Kernel("q8_combine_kernel", 102, 18)]
    s = summarize(ks, rounds=2)
    assert s["window_us_per_round"] == 60.0 and s["busy_us_per_round"] == 35.0
    assert s["idle_us_per_round"] == pytest.approx(25.0)
    pr = s["per_round"]
    assert pr["combine"] == {"count": 1.0, "us": 24.0} and pr["post"] == {"count": 1.0, "us": 2.0}
    assert pr["experts"]["us"] == 4.0 and pr["attention"]["us"] == 5.0
    assert summarize([], 3) == {"kernels": 0, "rounds": 3}


def test_kinds_and_chrome_trace_reader():
    assert kind_of("q8_quantize_kernel") == "quantize" and kind_of("ampere_sgemm_128x64") == "other"
    doc = {"traceEvents": [{"cat": "kernel", "name": "k", "ts": 5.0, "dur": 2.5},
                           {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 9.0},
                           {"cat": "kernel", "name": "flow", "ts": 7.0}]}
    assert kernels_of_chrome_trace(doc) == [Kernel("k", 5.0, 2.5)]


def test_trace_runs_without_a_gpu():
    with kernel_trace() as trace:
        torch.ones(64, 64) @ torch.ones(64, 64)
    if not torch.cuda.is_available():
        assert trace.kernels == []
    else:
        assert trace.kernels

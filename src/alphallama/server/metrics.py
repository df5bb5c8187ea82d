"""Counters for GET /metrics, written in Prometheus' plain-text exposition format.

Updated from the event loop (requests, rejections) and from the engine's worker thread
(tokens, timings), hence the lock. One Metrics object belongs to one app.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

_PREFIX = "alphallama_"


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str]] = Counter()   # (endpoint, outcome) -> count
        self.prompt_tokens = 0            # full prompt lengths
        self.prompt_tokens_computed = 0   # rows actually prefilled (after KV prefix re-use)
        self.prompt_seconds = 0.0
        self.tokens_predicted = 0
        self.predicted_seconds = 0.0
        self.draft_tokens = 0
        self.draft_tokens_accepted = 0
        self.last_decode_tps = 0.0

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def generation(self, prompt_tokens: int, timings: dict) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.prompt_tokens_computed += timings["prompt_n"]
            self.prompt_seconds += timings["prompt_ms"] / 1000
            self.tokens_predicted += timings["predicted_n"]
            self.predicted_seconds += timings["predicted_ms"] / 1000
            self.draft_tokens += timings["draft_n"]
            self.draft_tokens_accepted += timings["draft_n_accepted"]
            if timings["predicted_n"] > 0:
                self.last_decode_tps = timings["predicted_per_second"]

    def render(self, queue_depth: int, processing: int, loaded: bool, store: dict | None = None) -> str:
        """The exposition text. Gauges that live elsewhere (queue, load state, an offloaded
        model's expert store: StoreRounds.store_figures) are passed in."""
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                out.append(f"# HELP {_PREFIX}{name} {help_}")
                out.append(f"# TYPE {_PREFIX}{name} {kind}")
                out.extend(f"{_PREFIX}{name}{labels} {_num(v)}" for labels, v in samples)

            one: Callable[[float], list[tuple[str, float]]] = lambda v: [("", v)]
            metric("requests_total", "counter", "Completion requests by endpoint and outcome.",
                   [(f'{{endpoint="{e}",outcome="{o}"}}', n) for (e, o), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens received.", one(self.prompt_tokens))
            metric("prompt_tokens_computed_total", "counter",
                   "Prompt tokens prefilled (the rest came from the KV cache).", one(self.prompt_tokens_computed))
            metric("prompt_seconds_total", "counter", "Time spent in prefill.", one(self.prompt_seconds))
            metric("tokens_predicted_total", "counter", "Tokens generated.", one(self.tokens_predicted))
            metric("predicted_seconds_total", "counter", "Time spent decoding.", one(self.predicted_seconds))
            metric("decode_tokens_per_second", "gauge",
                   "Decode speed of the last finished generation.", one(self.last_decode_tps))
            metric("draft_tokens_total", "counter", "Speculative draft tokens verified.", one(self.draft_tokens))
            metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.",
                   one(self.draft_tokens_accepted))
        metric("queue_depth", "gauge", "Requests waiting for the engine.", one(queue_depth))
        metric("requests_processing", "gauge", "Requests being generated (at most the slots, -np).", one(processing))
        metric("model_loaded", "gauge", "1 once the model is loaded.", one(int(loaded)))
        if store is not None:
            _store_metrics(metric, store)
        return "\n".join(out) + "\n"


def _store_metrics(metric: Callable, s: dict) -> None:
    """An expert store's counters (the bank's hit rate is hits / lookups between two scrapes)."""
    one = lambda v: [("", v)]   # noqa: E731
    metric("expert_lookups_total", "counter", "Routed expert picks (row, rank) of the expert store.", one(s["lookups"]))
    metric("expert_hits_total", "counter", "Of those, picks served from the VRAM bank.", one(s["hits"]))
    metric("expert_admissions_total", "counter", "Experts copied into the VRAM bank.", one(s["admissions"]))
    metric("expert_admitted_bytes_total", "counter", "Bytes copied into the VRAM bank.", one(s["admitted_bytes"]))
    metric("expert_tier_bytes", "gauge", "Expert bytes by tier: the VRAM bank, pinned host RAM, the mapped file.",
           [(f'{{tier="{t}"}}', s[f"{t}_bytes"]) for t in ("bank", "host", "mapped")])
    if s.get("cpu_share") is not None:
        metric("expert_cpu_share", "gauge", "The CPU workers' share of the host tier's missed experts.",
               one(s["cpu_share"]))
    c = s.get("cpu_clock")
    if c:   # the workers' clock (offload/native/pool.c): a round's parts from two scrapes
        metric("expert_cpu_posts_total", "counter", "MoE layers' posts the CPU workers served.", one(c["posts"]))
        metric("expert_cpu_busy_seconds_total", "counter", "Time from a post seen to its results out.",
               one(c["busy_ns"] / 1e9))
        metric("expert_cpu_gap_seconds_total", "counter",
               "Time from the workers' results to the next post, when under 2 ms (the GPU's part between them).",
               one(c["gap_ns"] / 1e9))
        metric("expert_cpu_gaps_total", "counter", "Gaps counted in expert_cpu_gap_seconds_total.", one(c["gaps"]))
        metric("expert_cpu_pairs_total", "counter", "(row, rank) pairs the workers computed.", one(c["pairs"]))
        metric("expert_cpu_groups_total", "counter", "Distinct experts of those posts (each read from RAM once).",
               one(c["groups"]))


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))

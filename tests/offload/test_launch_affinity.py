"""The round-launching thread is pinned apart from the CPU workers (offload/cpu_tier.py) and
gets its own cpus back when the tier goes: a second store in the same process (a reload, a
benchmark's next arm) must find the cpus the first one found, not the one cpu the launch
thread was pinned to (on the device that put all 15 workers of every later arm on one
core: 10x slower rounds)."""
from __future__ import annotations

import gc
import os

import pytest

from alphallama.gguf.reader import GGUFFile
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.overrides import Overrides
from tests.offload.conftest import in_a_thread

CHEAP = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))


needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux thread affinity and two cpus")


def _store(path: str) -> GPUModel:
    """A fresh store with CPU workers, built in the calling thread."""
    model = GPUModel(GGUFFile(path), 64, device="cpu", expert_slots=2, cpu_tier=True, cpu_threads=1, overrides=CHEAP)
    if model.cpu_tier is None:
        pytest.skip("no CPU workers here (no C compiler)")
    return model


def _pinned(path: str) -> tuple[GPUModel, set[int], set[int]]:
    """(a store, this thread's cpus before, after its launch thread was pinned apart, as a GPU
    round's launch does)."""
    before = os.sched_getaffinity(0)
    model = _store(path)
    model.cpu_tier.keep_launch_thread_apart()
    return model, before, os.sched_getaffinity(0)


@needs_affinity
def test_a_second_store_finds_the_cpus_the_first_found(micro_moe):
    def arms():
        model, before, pinned = _pinned(micro_moe)
        del model
        gc.collect()
        after = os.sched_getaffinity(0)
        second = _store(micro_moe)
        return before, pinned, after, list(second.cpu_tier.experts.cpus), set(second.cpu_tier.launch_cpus)

    before, pinned, after, workers, launch = in_a_thread(arms)
    assert pinned < before                              # pinned apart while the tier lived
    assert after == before                              # given back when it went
    assert workers and launch and launch.isdisjoint(workers) and launch | set(workers) <= before


@needs_affinity
def test_release_gives_the_cpus_back_while_the_tier_lives(micro_moe):
    def pin_and_release():
        model, before, pinned = _pinned(micro_moe)
        model.cpu_tier.release_launch_threads()
        return before, pinned, os.sched_getaffinity(0)

    before, pinned, released = in_a_thread(pin_and_release)
    assert pinned < before and released == before

"""A micro qwen3moe for the offload tests: two layers whose experts differ in format
(Q8_0 / Q4_0 ffn_down: two bank classes), small enough for the Triton interpreter."""
from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede the kernels' import

from gguf.constants import GGMLQuantizationType as T  # noqa: E402

from alphallama.gguf.writer import SyntheticSpec, uniform_mix, write_synthetic  # noqa: E402

MICRO_MOE = SyntheticSpec(arch="qwen3moe", name="micro-moe", n_layers=2, d_model=64, n_heads=2, n_kv_heads=1,
                          head_dim=32, d_ff=128, n_experts=6, n_experts_used=2, d_ff_expert=64, vocab_size=260,
                          ctx_len=256, quant=uniform_mix(T.Q8_0) | {"blk.1.ffn_down_exps": T.Q4_0}, seed=1)


@pytest.fixture(scope="session")
def micro_moe(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("offload") / "micro-moe.gguf"
    write_synthetic(MICRO_MOE, path)
    return str(path)


def in_a_thread(fn):
    """fn() in a thread of its own (affinity is per thread: the runner's stays untouched)."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:          # noqa: BLE001 (re-raised in the caller)
            out["error"] = e
    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]

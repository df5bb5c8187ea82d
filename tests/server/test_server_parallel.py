"""Parallel streams through the server (-np 2, the CPU reference: its streams interleave):
two concurrent requests decode together (each one's chunks arrive while the other's do),
each gets the text it gets alone, a third waits for a free slot; /slots shows both slots
and /props total_slots. A model with an MTP head at -np 2 (`--spec-type mtp`): each stream drafts
from its own slot's MTP state, each text its text alone. A Gated DeltaNet hybrid on the GPU
runtime (the interpreter) at -np 2: its streams in shared rounds, each text its text alone."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from alphallama.engine import Engine

from serverutil import _one_torch_thread, serve  # noqa: F401

MODEL = "stories260K.gguf"
PROMPTS = ["Once upon a time", "The little dog ran to the", "Tom had a red ball and"]
N = 96    # long enough that 0 and 1, started together, are both decoding for most of it


@pytest.fixture(scope="module")
def alone(stories_path) -> list[str]:
    e = Engine.load(str(stories_path), ctx_size=512)
    out = []
    for p in PROMPTS:
        e.reset()
        out.append(e.tokenizer.decode(list(e.generate(e.encode_prompt(p), N)), continuation=True))
    return out


def _streams(server, model: str, prompts: list, n: list[int]) -> tuple[list[threading.Thread], dict, dict]:
    """A thread per prompt, not started, that streams its greedy completion of n[i] tokens:
    (threads, times, texts), each chunk's arrival time and the joined text filled as they run."""
    times: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    texts: dict[int, str] = {}

    def run(i: int) -> None:
        stream = server.client().completions.create(model=model, prompt=prompts[i], max_tokens=n[i],
                                                    temperature=0, stream=True)
        parts = []
        for chunk in stream:
            times[i].append(time.monotonic())
            parts.append(chunk.choices[0].text)
        texts[i] = "".join(parts)
    return [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))], times, texts


def _second_inside_first(threads: list[threading.Thread], times: dict) -> None:
    """Start stream 0, then stream 1 once 0's first chunk came (the interpreter holds the GIL: a
    request reaches the worker's rounds after it was sent); wait for both."""
    threads[0].start()
    while not times[0] and threads[0].is_alive():
        time.sleep(0.01)
    threads[1].start()
    for t in threads:
        t.join(120)


def test_two_requests_decode_together_and_a_third_waits(stories_path, alone):
    engine = Engine.load(str(stories_path), ctx_size=512, slots=2)
    assert engine.ctx_size == 256 and len(engine.slots) == 2
    with serve(engine, stories_path) as server:
        threads, times, texts = _streams(server, MODEL, PROMPTS, [N] * 3)
        threads[0].start()
        threads[1].start()                 # 0 and 1 together (a gap let 0 end first on a loaded machine)
        while min(len(times[0]), len(times[1])) < 8 and threads[0].is_alive() and threads[1].is_alive():
            time.sleep(0.005)
        sent = time.monotonic()
        threads[2].start()                 # then 2, while both decode: it waits for a slot
        for t in threads:
            t.join(60)
        assert [texts[i] for i in range(3)] == alone
        # 0 and 1 overlap: each one's first chunk came before the other's last
        assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1]
        # 2 waited for a slot: its first chunk after one of them was all but done. Not after its
        # last chunk: that one and 2's first leave the server within a round of each other, and
        # the client's threads record them in either order (CI saw 2's first 0.16 ms early)
        assert sent < min(times[0][-4], times[1][-4]) < times[2][0]
        slots = httpx.get(server.base + "/slots", headers=server.headers).json()
        assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 256 for s in slots)
        assert not any(s["is_processing"] for s in slots)
        assert {s["id_task"] for s in slots} <= {0, 1, 2} and len({s["id_task"] for s in slots}) == 2
        props = httpx.get(server.base + "/props", headers=server.headers).json()
        assert props["total_slots"] == 2


def test_mtp_drafts_per_stream_at_np_2(tmp_path):
    """-np 2 with a model's in-file MTP head, loaded as `serve` loads it (a state per slot), the
    MTP drafter on every round (the CPU reference): two streaming requests decode together, each
    text is its prompt's plain greedy text alone, and each slot's MTP entries are its own
    stream's tokens."""
    from alphallama.gguf.writer import PRESETS, write_synthetic
    from alphallama.spec.config import SpecConfig
    path = tmp_path / "mtp.gguf"
    write_synthetic(PRESETS["tiny-qwen3"](n_layers=1, seed=7, ctx_len=512, mtp="dense"), path)
    solo = Engine.load(str(path), ctx_size=256, device="cpu")
    ids, alone = [], []
    for p in PROMPTS[:2]:
        solo.reset()
        ids.append(solo.encode_prompt(p))
        alone.append(solo.tokenizer.decode(list(solo.generate(ids[-1], N)), continuation=True))
    engine = Engine.load(str(path), ctx_size=512, device="cpu", slots=2)
    assert engine.slots[0].mtp is not None and engine.slots[0].mtp is not engine.slots[1].mtp
    spec = SpecConfig("mtp", mtp_depth=2, mtp_min_p=0.0, gate=False, mtp_switch=False)
    with serve(engine, path, spec=spec) as server:
        threads, times, texts = _streams(server, path.name, PROMPTS[:2], [N, N])
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [texts[0], texts[1]] == alone
        assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1]        # together
    owners = [next(s for s in engine.slots if s.mtp.seq[:len(i)] == i) for i in ids]    # its stream's entries
    assert owners[0] is not owners[1]
    assert all(len(s.mtp.seq) > len(i) + 1 for s, i in zip(owners, ids))   # its rounds' too (its drafts)
    assert all(len(t) > 20 for t in alone)


def test_np_leaving_a_slot_too_little_context_is_refused(stories_path):
    with pytest.raises(ValueError, match="-np 8 leaves each slot 64 tokens"):
        Engine.load(str(stories_path), ctx_size=512, slots=8)
    with pytest.raises(ValueError, match="at least 1"):
        Engine.load(str(stories_path), ctx_size=512, slots=0)


def test_a_hybrid_on_the_gpu_runtime_decodes_streams_together(tmp_path):
    """-np 2 on a Gated DeltaNet hybrid (tiny qwen35) through the GPU runtime (the interpreter
    here): two streaming requests decode in shared rounds, each its own slot's recurrent state,
    and each text is its prompt's text alone on a one-slot engine."""
    from alphallama.gguf.reader import GGUFFile
    from alphallama.gguf.writer import PRESETS, write_synthetic
    from alphallama.runtime.gpu_hybrid import GPUHybridModel
    from alphallama.runtime.overrides import Overrides
    from alphallama.spec.config import SpecConfig
    from alphallama.tokenizer import Tokenizer
    path = tmp_path / "qwen35.gguf"           # tests/runtime/test_gpu_hybrid.py's tiny shape: 2 layers of 64
    write_synthetic(PRESETS["tiny-qwen35"](n_layers=2, full_attention_interval=2, d_model=64, n_heads=2, n_kv_heads=1,
                                           head_dim=32, d_ff=64, vocab_size=288, rope_dim=16, quant="Q8_0", seed=3),
                    path)
    f = GGUFFile(path)

    def engine(slots: int) -> Engine:
        model = GPUHybridModel(f, 40, device="cpu", overrides=Overrides(decode_gemv="f32", attention_tiles=(16, 4)))
        return Engine(f, model, Tokenizer.from_metadata(f.metadata), None, 40, slots=slots)
    # the first runs long and the second starts once the first streams: the interpreter holds the
    # GIL, so a request reaches the worker rounds after it was sent
    prompts, n = [[5, 17, 99, 3, 42], [250, 7, 7]], [10, 3]
    solo = engine(1)
    alone = []
    for p, k in zip(prompts, n):
        solo.reset()
        alone.append(solo.tokenizer.decode(list(solo.generate(p, k)), continuation=True))
    with serve(engine(2), path, spec=SpecConfig("none")) as server:
        threads, times, texts = _streams(server, path.name, prompts, n)
        _second_inside_first(threads, times)
        assert [texts[0], texts[1]] == alone
        assert times[0][0] < times[1][0] and times[1][-1] < times[0][-1]     # 1 ran inside 0's run


def test_an_expert_store_serves_streams_together(tmp_path):
    """-np 2 on the micro MoE with an expert store (a bank of 3 of its 12 experts, admissions
    paced to happen mid-run) through the GPU runtime (the interpreter) and the HTTP server:
    two streaming requests decode in shared passes, each text its prompt's text alone on a
    one-slot model with every expert resident."""
    from alphallama.gguf.reader import GGUFFile
    from alphallama.gguf.writer import write_synthetic
    from alphallama.runtime.gpu_model import GPUModel
    from alphallama.runtime.overrides import Overrides
    from alphallama.spec.config import SpecConfig
    from alphallama.tokenizer import Tokenizer
    from tests.offload.conftest import MICRO_MOE
    path = tmp_path / "micro-moe.gguf"
    write_synthetic(MICRO_MOE, path)
    f = GGUFFile(path)
    cheap = Overrides(decode_gemv="f32", moe_gemv="f32", attention_tiles=(16, 4))

    def engine(slots: int, store: bool) -> Engine:
        model = GPUModel(f, 40, device="cpu", expert_slots=3 if store else None, cpu_tier=False, overrides=cheap)
        if store:
            model.store.policy.margin = 0.0
            model.store.admit_bytes_per_round, model.store.chunk_bytes = 4096, 1024
        return Engine(f, model, Tokenizer.from_metadata(f.metadata), None, 40, slots=slots)
    prompts, n = [[155, 140, 140, 140, 7], [250, 17, 42]], [10, 3]
    solo = engine(1, store=False)
    alone = []
    for p, k in zip(prompts, n):
        solo.reset()
        alone.append(solo.tokenizer.decode(list(solo.generate(p, k)), continuation=True))
    served = engine(2, store=True)
    with serve(served, path, spec=SpecConfig("none")) as server:
        threads, times, texts = _streams(server, path.name, prompts, n)
        _second_inside_first(threads, times)
        assert [texts[0], texts[1]] == alone
        assert times[0][0] < times[1][0] and times[1][-1] < times[0][-1]     # 1 ran inside 0's run
    assert served.model.store.stats.admissions > 0

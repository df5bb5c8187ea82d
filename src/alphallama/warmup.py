"""The warm-up at load: the first request as fast as every later one.

What a request would otherwise prepare lazily, the first time, on its own clock:
  - the round-cost table of the confidence gate (spec/gate.py): timed once per model,
    device and verify mode (seconds), read from the disk cache after that;
  - on the GPU, every kernel the prefill path launches (Triton compiles on first use, and
    per specialization of its row count: a full 512-row chunk and a ragged one differ),
    cuBLAS/SDPA's lazily loaded kernels, the MTP head's draft vocabulary and graphs.
So the loader runs one real generation through the same code a request takes: a prompt
long enough for every prefill shape the device compiles, then a few speculative rounds,
greedy. Everything it leaves behind is then undone: the KV cache and its token list are
cleared (so no prefix is re-used from it), the MTP cache too, and what speculation
learned about acceptance is thrown away (the warm-up runs on a copy of the memory; only
the measured cost table, a property of the model and device, is kept).
"""
from __future__ import annotations

from dataclasses import replace

from .config import DEFAULTS
from .engine import Engine, Generation
from .sampling import SamplingParams
from .spec.config import ModelMemory, SpecConfig, SpecMemory

# a text with repeats: the copy drafter finds matches, so verify rounds of several widths run
_TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps on. "
_NEW_TOKENS = 8


def warmup_rows(engine: Engine) -> int:
    """Prompt rows the warm-up prefills. The GPU compiles per shape: one full prefill
    chunk, a ragged chunk after it (a different specialization, at a position > 0) and the
    last row alone. The CPU reference compiles nothing, so a short prompt does there."""
    room = engine.ctx_size - _NEW_TOKENS - 1
    if engine.cache.k.device.type == "cuda":
        chunk = DEFAULTS.engine.prefill_chunk
        return max(2, min(chunk + chunk // 4 + 1, room))
    return max(2, min(16, room))


def warmup_prompt(engine: Engine, rows: int) -> list[int]:
    """`rows` ids of ordinary text, without end-of-generation ids (they would stop it early)."""
    text = _TEXT
    ids = engine.encode_prompt(text)
    while len(ids) < rows:        # doubling: the tokenizer sees at most twice the text needed
        text += text
        ids = engine.encode_prompt(text)
    stop = engine.tokenizer.stop_ids
    return [t for t in ids if t not in stop][:rows]


def warm_up(engine: Engine, spec: SpecConfig, rows: int | None = None) -> None:
    """Run one throw-away generation with `spec` (resolved for the engine's device) and
    leave the engine as a fresh load leaves it; the cost table it measured is kept in
    `spec`'s memory (shared by every request of a server). rows: the prompt's length
    (default: warmup_rows)."""
    resolved = spec.on_device(engine.cache.k.device.type)
    scratch = SpecMemory()
    ids = warmup_prompt(engine, rows if rows is not None else warmup_rows(engine))
    try:
        for _ in engine.generate(ids, _NEW_TOKENS, SamplingParams(temperature=0.0), gen=Generation(),
                                 spec=replace(resolved, memory=scratch)):
            pass
    finally:
        engine.reset()
    for key, mem in scratch.models.items():   # keep the timed table, not what was learned
        if mem.table is not None:
            spec.memory.models.setdefault(key, ModelMemory()).table = mem.table

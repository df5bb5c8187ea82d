"""The warm-up at load: the first request as fast as every later one.

What a request would otherwise prepare lazily, the first time, on its own clock:
  - the round-cost table of the confidence gate (spec/gate.py): timed once per model,
    device and verify mode (seconds), read from the disk cache after that;
  - on the GPU, the prefill path's CUDA graphs, captured per chunk shape on first use
    (with the compile of its Triton kernels, cuBLAS's and SDPA's lazily loaded kernels,
    the scratch of dequantized weights): 2.5 s on the H200 for the first prompt over 512
    tokens; and the MTP head's draft vocabulary;
  - on the CPU, torch's first calls (BLAS and thread-pool set-up: over a second).
So the loader runs real generations through the code a request takes: prompts whose
chunks take every prefill shape (warmup_runs), each followed by a few speculative
rounds, greedy, then one sampled with logprobs. Everything they leave behind is then undone: the KV cache and its token
list are cleared (so no prefix is re-used from them), the MTP cache too, and what
speculation learned about acceptance is thrown away (the warm-up runs on a fresh memory;
only the measured cost table, a property of the model and device, is kept).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import DEFAULTS
from .engine import Engine, Generation
from .sampling import SamplingParams
from .spec.config import ModelMemory, SpecConfig, SpecMemory

# a text with repeats: the copy drafter finds matches, so verify rounds of several widths run
_TEXT = "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps on. "
_NEW_TOKENS = 4
_GREEDY = SamplingParams(temperature=0.0)
_SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0)


@dataclass(frozen=True)
class WarmRun:
    """One throw-away generation: a prompt of `rows` tokens, then _NEW_TOKENS."""
    rows: int
    sampling: SamplingParams = _GREEDY
    logprobs: int | None = None


def warmup_runs(engine: Engine) -> list[WarmRun]:
    """The warm-up's generations, each on a fresh cache.

    On the GPU, prompt chunks of more than the decode rounds' 64 rows take the prefill
    path, captured per padded row count (runtime/gpu_prefill.graph_rows: the chunk, or the
    power of two above a shorter one) on first use, with SDPA's causal mask for a chunk at
    position 0 and a bottom-right one after it. So: a full chunk with a half-chunk tail
    (+1: the last row always goes alone through the decode graphs), then each smaller
    power of two down to the decode rounds' width; then the sampler's path (top-k/p,
    min-p, speculative sampling, logprobs) on the shortest. The CPU reference compiles
    and captures nothing: one short greedy prompt does there (torch's first BLAS calls,
    1.4 s of a 20 ms request on stories260K here; the cost table, the drafters)."""
    room = engine.ctx_size - _NEW_TOKENS - 1
    if engine.cache.k.device.type != "cuda":
        return [WarmRun(max(1, min(16, room)))]
    from .runtime.gpu_model import MAX_W
    chunk = DEFAULTS.engine.prefill_chunk
    lengths, rows = [chunk + chunk // 2 + 1], chunk // 4
    while rows > MAX_W:
        lengths.append(rows + 1)
        rows //= 2
    lengths = list(dict.fromkeys(max(1, min(n, room)) for n in lengths))   # a short context: its longest prompt
    return [WarmRun(n) for n in lengths] + [WarmRun(min(lengths), _SAMPLED, 1)]


def warmup_prompt(engine: Engine, rows: int) -> list[int]:
    """`rows` ids of ordinary text, without end-of-generation ids (they would stop it early)."""
    text = _TEXT
    ids = engine.encode_prompt(text)
    while len(ids) < rows:        # doubling: the tokenizer sees at most twice the text needed
        text += text
        ids = engine.encode_prompt(text)
    stop = engine.tokenizer.stop_ids
    return [t for t in ids if t not in stop][:rows]


def warm_up(engine: Engine, spec: SpecConfig, runs: list[WarmRun] | None = None) -> None:
    """Run throw-away generations with `spec` (resolved for the engine's device) and leave
    the engine as a fresh load leaves it; the cost table they measured is kept in `spec`'s
    memory (shared by every request of a server). runs: default warmup_runs(engine)."""
    resolved = replace(spec.on_device(engine.cache.k.device.type), memory=SpecMemory())
    scratch = resolved.memory
    for run in runs if runs is not None else warmup_runs(engine):
        ids = warmup_prompt(engine, run.rows)
        try:
            for _ in engine.generate(ids, _NEW_TOKENS, run.sampling, gen=Generation(), spec=resolved,
                                     logprobs=run.logprobs):
                pass
        finally:
            engine.reset()
    for key, mem in scratch.models.items():   # keep the timed table, not what was learned
        if mem.table is not None:
            spec.memory.models.setdefault(key, ModelMemory()).table = mem.table

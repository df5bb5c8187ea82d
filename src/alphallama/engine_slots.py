"""The engine's slots: where each stream's KV rows and committed tokens live.

One slot (`-np 1`, the default) is the engine's whole cache, as it always was. N slots
(`-np N`, parallel streams) split it: on the GPU runtime one cache of N slots whose rows
share a round (runtime/gpu_model.round, kernels/attention/rows.py; the hybrids' each stream's
recurrent state too: runtime/gpu_hybrid.round), on the CPU reference one cache each (its exact
verify runs rows one by one, so streams there interleave). A model with an MTP head gives each
slot its own MTP state too (spec/mtp.py: the head's entries for the slot's tokens, its staged
rows), so each stream drafts from its own history.

A request takes the free slot that already holds the longest prefix of its prompt, then
the least recently used, then the lowest id: a deterministic function of the request
sequence (exact mode's guarantee for a continued conversation is "equal to plain
decoding from the same cache state", decisions/parallel-streams.md).

The driver's messages: a stream (Engine.stream, a generator) yields token ids, CHUNK
after each prompt chunk it prefilled (a point where other streams may run), a Claim
(spec/allot.py) for its next round's drafts (none, if its drafter drafted nothing), to which
the driver sends its Seat (how many of them the round verifies, beside what other rows), and
Verify for its next round's rows, to which it sends (logits, hidden).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .spec.drafter import common_prefix


@dataclass(eq=False)
class Slot:
    id: int
    cache: Any                     # KVCache, a KVSlot of the shared one, or a hybrid's cache
    cached: list[int] = field(default_factory=list)   # tokens whose rows the cache has committed
    used: int = 0                  # when a request last took it (the LRU order; 0: never)
    busy: bool = False             # a stream or an engine call holds it
    mtp: Any = None                # spec.mtp.MTPState: its MTP head's entries (a model with a head)


MIN_SLOT_CONTEXT = 128   # the fewest tokens of context a slot may have


def slot_context(ctx: int, n: int) -> int:
    """Each of n slots' context when the whole is ctx (llama-server's n_ctx / N); ValueError
    when n is not a positive count or leaves a slot too little."""
    if n < 1:
        raise ValueError(f"-np must be at least 1, got {n}")
    if n > 1 and ctx // n < MIN_SLOT_CONTEXT:
        raise ValueError(f"-np {n} leaves each slot {ctx // n} tokens of a {ctx}-token context; a slot needs at "
                         f"least {MIN_SLOT_CONTEXT}: raise -c or lower -np")
    return ctx // n


def new_slots(model, ctx: int, n: int, mtp=None) -> list[Slot]:
    """n slots of ctx rows each: one model cache for n == 1; a model that puts several
    streams' rows in one pass (`round`) splits one cache; another (the CPU reference) gets
    a cache per slot. mtp: each slot's MTP state (a list of n, or one state for n == 1)."""
    if n < 1:
        raise ValueError(f"-np must be at least 1, got {n}")
    states = [None] * n if mtp is None else mtp if isinstance(mtp, list) else [mtp]
    if len(states) != n:
        raise ValueError(f"{len(states)} MTP states for {n} slots: one per slot (spec.mtp.slot_states)")
    if n == 1:
        caches = [model.new_cache(ctx)]
    elif getattr(model, "round", None) is not None:
        caches = model.new_cache(ctx, slots=n).split(n, ctx)
    else:
        caches = [model.new_cache(ctx) for _ in range(n)]
    return [Slot(i, c, mtp=m) for i, (c, m) in enumerate(zip(caches, states))]


def choose_slot(slots: list[Slot], ids: list[int]) -> Slot:
    """The free slot for a prompt: longest common prefix with its cached tokens, then least
    recently used, then lowest id. ValueError if none is free."""
    free = [s for s in slots if not s.busy]
    if not free:
        raise ValueError(f"all {len(slots)} slots are busy")
    return min(free, key=lambda s: (-common_prefix(s.cached, ids), s.used, s.id))


def timing_slot(slots: list[Slot], own: Slot | None, rows: int, forget: Callable[[Slot], None]) -> Slot:
    """Where the cost table's rounds may be timed (spec/gate.measure: `rows` rows past a
    cache's committed ones, inside KVCache.trial, so the slot keeps its rows and state)
    without touching another stream's state: `own` (the asking request's slot, before its
    prompt) or else a free slot, the first with room; else `own` (else the first free
    slot) forgotten (forget: Engine.reset_slot; its next prompt is prefilled whole).
    ValueError when every slot is another stream's."""
    candidates = ([own] if own is not None else []) + [s for s in slots if not s.busy and s is not own]
    if not candidates:
        raise ValueError(f"no slot to time the round costs on: all {len(slots)} are other streams'")
    for s in candidates:
        if s.cache.length + rows <= s.cache.max_len:
            return s
    forget(candidates[0])
    return candidates[0]


@dataclass(frozen=True)
class Verify:
    """A stream's rows for the next round: tokens [w] int64 at positions pos.. of `cache`."""
    tokens: torch.Tensor
    pos: int
    cache: Any
    exact: bool


class Chunk:
    """Yielded by a stream after each prompt chunk it prefilled."""


CHUNK = Chunk()


def run_round(model, parts: list[Verify]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every part's verify: in shared passes where the model has them (GPUModel.round),
    else one after another. -> [(logits [w, V], hidden [w, D])] per part."""
    batched = getattr(model, "round", None)
    if batched is not None and len({p.exact for p in parts}) == 1:
        return batched([(p.tokens, p.pos, p.cache) for p in parts], exact=parts[0].exact)
    return [model.verify(p.tokens, p.pos, p.cache, exact=p.exact) for p in parts]


def drain(gen):
    """Run a generator of CHUNKs to its end -> its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value

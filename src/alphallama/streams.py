"""Parallel streams: several requests' loop bodies (Engine.stream) driven in shared rounds.

Each step (`Streams.step`):
  1. the oldest stream still prefilling runs one prompt chunk (or, its prompt done, its
     last row and first token): a new request never stalls the others for a whole
     long prompt, and its prompt is computed alone, from its own chunks (never mixed into
     a decode round: a prompt's K/V bits must not depend on the traffic);
  2. the round's rows allotted: every decoding stream has one row (its last token) and
     the drafts it claims (spec/allot.py: greedily by expected tokens per marginal ms at
     the round's total width, MAX_WIDTH rows in all), so a stream's drafts are priced at
     what they add to the shared round, not at what they would cost it alone; each claim
     is answered with its seat (its drafts and the rest of the round: its policy prices
     what it learns from the round in it, spec/seated.py);
  3. one round over every decoding stream's rows (engine_slots.run_round: one pass on the
     GPU runtime, each row at its own position in its own slot), then each stream accepts
     its own rows and hands its new tokens to its `on_token`, which returns False to stop
     it (a stop string, a cancel);
  4. the streams that ended are returned (their slots freed) for the caller to finish.

A stream's failure (raised from its own step) ends that stream only, with `error` set;
a failure of the shared round raises from `step`: every stream's state is then unknown,
the caller fails them all (`close_all`) and resets the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generator

from .engine import Engine
from .engine_slots import CHUNK, Slot, Verify, run_round
from .spec.allot import Claim, allot, round_room, seats
from .spec.gate import MAX_WIDTH


@dataclass(eq=False)
class StreamRun:
    core: Generator
    slot: Slot
    on_token: Callable[[int], bool]
    msg: object = None                  # what the core yielded last (None: not started)
    done: bool = False
    stopped: bool = False               # on_token said stop (or close() was called)
    error: BaseException | None = None
    rows: list[int] = field(default_factory=list)    # rows this stream put in each round (the bench's)

    @property
    def prefilling(self) -> bool:
        return not self.done and (self.msg is None or self.msg is CHUNK)


class Streams:
    def __init__(self, engine: Engine, max_rows: int = MAX_WIDTH):
        """max_rows: the most rows a round verifies (drafts are allotted up to it)."""
        self.engine = engine
        self.max_rows = max_rows
        self.runs: list[StreamRun] = []        # in arrival order
        self.width = 0                         # the last round's rows, every stream's together

    @property
    def free(self) -> int:
        """Slots no stream holds."""
        return sum(not s.busy for s in self.engine.slots)

    def add(self, prompt_ids: list[int], max_tokens: int, on_token: Callable[[int], bool], **kw) -> StreamRun:
        """A new stream (Engine.generate's keyword arguments) in the free slot choose_slot
        picks for its prompt, taken now: arrival order decides the slots."""
        slot = self.engine.take_slot(prompt_ids)
        run = StreamRun(self.engine.stream(prompt_ids, max_tokens, slot=slot, **kw), slot, on_token)
        self.runs.append(run)
        return run

    def close(self, run: StreamRun) -> None:
        """Stop a stream now (its generator's cleanup runs: timings final, slot freed)."""
        if not run.done:
            run.core.close()
            run.done = run.stopped = True
        run.slot.busy = False

    def close_all(self) -> list[StreamRun]:
        runs, self.runs = self.runs, []
        for run in runs:
            self.close(run)
        return runs

    def step(self) -> list[StreamRun]:
        """One prefill chunk and one round (the module docstring) -> the streams that ended."""
        waiting = [r for r in self.runs if r.prefilling]
        if waiting:
            self._advance(waiting[0], None)
        claiming = [r for r in self.runs if not r.done and isinstance(r.msg, Claim)]
        if claiming:             # the others (no drafts) are at their Verify of one row
            fixed = sum(r.msg.tokens.shape[0] for r in self.runs if not r.done and isinstance(r.msg, Verify))
            claims = [r.msg for r in claiming]
            drafts = allot(claims, fixed, round_room(fixed + len(claiming), self.max_rows))
            for r, seat in zip(claiming, seats(claims, fixed, drafts)):
                self._advance(r, seat)
        deciding = [r for r in self.runs if not r.done and isinstance(r.msg, Verify)]
        if deciding:
            self.width = sum(r.msg.tokens.shape[0] for r in deciding)
            outs = run_round(self.engine.model, [r.msg for r in deciding])
            for r, out in zip(deciding, outs):
                r.rows.append(r.msg.tokens.shape[0])
                self._advance(r, out)
        ended = [r for r in self.runs if r.done]
        self.runs = [r for r in self.runs if not r.done]
        for r in ended:
            r.slot.busy = False
        return ended

    def _advance(self, run: StreamRun, value) -> None:
        """Send `value` (a round's output, the seat allotted to its claim; None to start or
        after a chunk) and pass the tokens that follow to on_token, up to the stream's next
        CHUNK, Claim or Verify, or its end."""
        try:
            msg = run.core.send(value) if run.msg is not None else next(run.core)
            while isinstance(msg, int):
                if not run.on_token(msg):
                    self.close(run)
                    return
                msg = next(run.core)
            run.msg = msg
        except StopIteration:
            run.done = True
        except Exception as e:   # this stream's own step failed: it alone ends
            run.error, run.done = e, True

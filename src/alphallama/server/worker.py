"""The one thread that owns the engine, and the bounded FIFO queue in front of it.

Generation is long, synchronous CPU/GPU work, so it never runs on the event loop: a
single worker thread loads the model and then takes jobs in arrival order. With one
slot (-np 1, the default) it runs them one at a time; with N slots (parallel streams)
it runs rounds (worker_rounds.py): up to N jobs decode together, the rest wait in the
same FIFO queue. Its results go back to the request's coroutine through an
asyncio.Queue fed with call_soon_threadsafe.

Cancelling (client gone) sets a flag the worker checks after every token; it then
closes the engine's generator, which is how the engine stops, and takes the next job.
A job cancelled while still waiting simply leaves the queue.

Besides generations, a job may be an EngineCall: a function run on the engine in its
turn (embeddings, a prompt evaluated into the cache), answered with one Result.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Engine, Generation
from ..grammar import TokenConstraint
from ..sampling import SamplingParams
from ..spec.config import SpecConfig
from .errors import APIError
from .metrics import Metrics
from .textstream import TextStream
from .tool_stream import ShownSpecials

log = logging.getLogger("alphallama.server")


@dataclass(frozen=True)
class GenRequest:
    endpoint: str                 # "chat" | "completions" (for metrics)
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str] = field(default_factory=list)
    n_logprobs: int | None = None   # None: no logprobs; k: each token's and the top k
    constraint: TokenConstraint | None = None       # a grammar the output obeys (grammar.py)
    shown_tokens: frozenset[int] = frozenset()      # control tokens rendered as text (tool-call markers)
    ignore_eos: bool = False                        # end-of-generation tokens do not stop it (max_tokens does)

    @property
    def stop_ids(self) -> set[int] | None:
        """The engine's stop_ids: none when ignore_eos, else the tokenizer's (None)."""
        return set() if self.ignore_eos else None


@dataclass(frozen=True)
class EngineCall:
    """Work on the engine that is not a generation: fn(engine, cancelled) -> a value for Result."""
    endpoint: str                 # for metrics
    fn: Callable[[Engine, Callable[[], bool]], Any]


# -- what the worker sends back ---------------------------------------------------------

@dataclass
class Delta:
    text: str
    # (token id, its log-prob, [(id, log-prob)] top k) for the tokens behind this text
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    tokens: list[int] = field(default_factory=list)   # the ids behind this text (since the last Delta)


@dataclass
class Done:
    finish_reason: str            # "stop" | "length"
    completion_tokens: int
    timings: dict
    stop_word: str | None = None  # the stop string that ended it, if one did


@dataclass
class Result:
    value: Any                    # an EngineCall's answer


@dataclass
class Cancelled:
    pass


@dataclass
class Failed:
    error: APIError


Event = Delta | Done | Result | Cancelled | Failed


class Job:
    """One request's passage through the worker; iterate `events()` on the event loop."""

    def __init__(self, request: GenRequest | EngineCall, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = False     # a terminal event has been sent
        self.id: int | None = None   # given at submit, in arrival order (llama-server's id_task)
        self.n_decoded = 0        # tokens generated so far (the worker counts them; /slots reads them)

    def emit(self, event: Event) -> None:
        """Called from the worker thread."""
        if isinstance(event, (Done, Result, Cancelled, Failed)):
            self.finished = True
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:   # the event loop is gone (shutdown): nobody is listening
            self.cancelled.set()

    async def next(self) -> Event:
        return await self._events.get()


class EngineWorker:
    def __init__(self, load: Callable[[], Engine], spec: SpecConfig, queue_size: int, metrics: Metrics,
                 retry_after_s: int = 1, on_load_failed: Callable[[BaseException], None] | None = None):
        self._load = load
        self.spec = spec
        self.queue_size = queue_size
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self._on_load_failed = on_load_failed
        self.engine: Engine | None = None
        self.state = "loading"    # loading | ready | failed | stopped
        self.load_error: str | None = None
        self._waiting: collections.deque[Job] = collections.deque()
        self._current: Job | None = None
        self._last: Job | None = None    # the latest job the engine took (running or done)
        self.running: set[Job] = set()   # parallel streams: the jobs holding a slot
        self.slot_jobs: dict[int, Job] = {}   # slot id -> the latest job that ran on it
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="alphallama-engine", daemon=True)

    # -- called from the event loop ---------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.state != "ready":
                raise APIError("unavailable", self.unavailable_reason())
            if len(self._waiting) >= self.queue_size:
                raise APIError("rate_limit", f"the server is busy: {len(self._waiting)} requests are "
                               "already waiting for the engine; retry later",
                               headers={"Retry-After": str(self.retry_after_s)})
            job.id = next(self._ids)
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return   # running (the worker sees the flag at the next token) or finished
        self.metrics.request(job.request.endpoint, "cancelled")
        job.emit(Cancelled())

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self.state = "stopped"
            waiting, self._waiting = list(self._waiting), collections.deque()
            if self._current is not None:
                self._current.cancelled.set()
            for job in self.running:
                job.cancelled.set()
            self._cond.notify_all()
        for job in waiting:
            job.emit(Failed(APIError("unavailable", "the server is shutting down")))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def unavailable_reason(self) -> str:
        return {"loading": "the model is still loading; retry shortly",
                "failed": f"the model failed to load: {self.load_error}",
                "stopped": "the server is shutting down"}.get(self.state, "unavailable")

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def processing(self) -> int:
        return int(self._current is not None) + len(self.running)

    def store_figures(self) -> dict | None:
        """An offloaded model's expert store counters (runtime/store_rounds.py), else None."""
        figures = getattr(self.engine.model, "store_figures", None) if self.engine is not None else None
        return figures() if figures is not None else None

    @property
    def last_job(self) -> Job | None:
        """The job running now, else the one that ran last (None before the first)."""
        return self._last

    # -- the worker thread ------------------------------------------------------------
    def _main(self) -> None:
        try:
            engine = self._load()
        except BaseException as e:   # a broken file, out of memory: report, keep the server answering
            log.error("loading the model failed: %s", e)
            with self._cond:
                if self.state == "loading":
                    self.state, self.load_error = "failed", str(e)
            if self._on_load_failed is not None:
                self._on_load_failed(e)
            return
        with self._cond:
            self.engine = engine
            if self.state == "loading":
                self.state = "ready"
        if len(engine.slots) > 1:
            from .worker_rounds import run_rounds
            run_rounds(self, engine)
            return
        while True:
            with self._cond:
                while not self._waiting and self.state == "ready":
                    self._cond.wait()
                if self.state != "ready":
                    return
                job = self._current = self._last = self.slot_jobs[0] = self._waiting.popleft()
            try:
                self._run(engine, job)
            except Exception as e:   # the worker must survive anything one request does
                log.exception("generation failed")
                engine.reset()   # the cache's contents are unknown now: the next prompt is prefilled whole
                self.metrics.request(job.request.endpoint, "error")
                job.emit(Failed(APIError("server", f"generation failed: {type(e).__name__}: {e}")))
            finally:
                with self._cond:
                    self._current = None

    def _run(self, engine: Engine, job: Job) -> None:
        r = job.request
        if job.cancelled.is_set():   # the client left just as its turn came
            self.metrics.request(r.endpoint, "cancelled")
            job.emit(Cancelled())
            return
        if isinstance(r, EngineCall):
            value = r.fn(engine, job.cancelled.is_set)
            self.metrics.request(r.endpoint, "ok")
            job.emit(Result(value))
            return
        run = JobRun(engine, job, self.metrics)
        tokens = engine.generate(r.prompt_ids, r.max_tokens, r.sampling, stop_ids=r.stop_ids, gen=run.gen,
                                 spec=self.spec, logprobs=r.n_logprobs, cancel=job.cancelled.is_set, constraint=r.constraint)
        try:
            for tid in tokens:
                if not run.feed(tid):
                    break
        finally:
            tokens.close()   # stops the engine mid-generation; its timings are final after this
        run.end()


class JobRun:
    """One generation job's output side: its tokens turned into Deltas (stop strings, held-back
    text, logprobs) and its end into Done or Cancelled. Both worker loops feed it."""

    def __init__(self, engine: Engine, job: Job, metrics: Metrics):
        r = job.request
        self.job, self.metrics = job, metrics
        self.gen = Generation()
        detok = ShownSpecials(engine.tokenizer, r.shown_tokens) if r.shown_tokens else engine.tokenizer.stream()
        self.text = TextStream(detok, r.stops)
        self.pending: list[tuple[int, float, list[tuple[int, float]]]] = []
        self.ids: list[int] = []
        self.finish: str | None = None

    def feed(self, tid: int) -> bool:
        """One generated token -> whether to go on (False: a stop string matched, or cancelled)."""
        job, r = self.job, self.job.request
        job.n_decoded += 1
        self.ids.append(tid)
        if r.n_logprobs is not None:
            lp, top = self.gen.logprobs[-1]
            self.pending.append((tid, lp, top))
        piece = self.text.feed(tid)
        if piece:
            job.emit(Delta(piece, self.pending, self.ids))
            self.pending, self.ids = [], []
        if self.text.stopped:
            self.finish = "stop"
            return False
        return not job.cancelled.is_set()

    def end(self) -> None:
        """After the engine stopped (its timings final): Done, or Cancelled."""
        job, r, gen, text = self.job, self.job.request, self.gen, self.text
        timings = gen.stats.timings()
        self.metrics.generation(len(r.prompt_ids), timings)
        finish = self.finish
        if job.cancelled.is_set() and finish is None:
            self.metrics.request(r.endpoint, "cancelled")
            job.emit(Cancelled())
            return
        if finish is None:
            tail = text.finish()
            if tail or self.pending or self.ids:
                job.emit(Delta(tail, self.pending, self.ids))
            finish = "stop" if text.stopped else (gen.finish_reason or "length")
        elif self.ids:   # a stop string ended it: the ids behind the held-back text (llama-server sends them too)
            job.emit(Delta("", [], self.ids))
        self.metrics.request(r.endpoint, "ok")
        job.emit(Done(finish, len(gen.tokens), timings, text.matched))

"""The worker's loop for parallel streams (-np N > 1): rounds instead of one job at a time.

Each turn of the loop, under the worker's lock, admits waiting jobs in arrival order
while a slot is free (FIFO: a later job never passes an earlier one; --queue-size counts
the waiting only), then, outside it:
  - an EngineCall (embeddings, a prompt evaluated into the cache) runs at once, on a
    free slot the engine picks, and is answered;
  - a generation becomes a stream in the next free slot (streams.Streams.add);
  - a job whose client left is stopped: its slot is free within a round;
  - one step of the streams (one prompt chunk of the oldest stream still prefilling, one
    round over every decoding stream); each stream's tokens go to its job as they come
    (worker.JobRun), and the streams that ended are answered (Done, Cancelled, Failed).
A failure in one stream's own step fails that job and forgets its slot's rows; a failure
of the shared round fails every running job and resets the engine, as the one-job loop
does for its job.
"""
from __future__ import annotations

import logging

from ..engine import Engine
from ..streams import StreamRun, Streams
from .errors import APIError
from .worker import Cancelled, EngineCall, EngineWorker, Failed, Job, JobRun, Result

log = logging.getLogger("alphallama.server")


def run_rounds(w: EngineWorker, engine: Engine) -> None:
    streams = Streams(engine)
    runs: dict[StreamRun, JobRun] = {}
    while True:
        with w._cond:
            while not w._waiting and not streams.runs and w.state == "ready":
                w._cond.wait()
            if w.state != "ready":
                _fail(w, streams, runs, "the server is shutting down", "unavailable")
                return
            admitted = []
            while w._waiting and streams.free > len([j for j in admitted if not isinstance(j.request, EngineCall)]):
                job = w._waiting.popleft()
                admitted.append(job)
                w._last = job
                w.running.add(job)
        for job in admitted:
            _admit(w, engine, streams, runs, job)
        for run, jr in runs.items():
            if jr.job.cancelled.is_set():
                streams.close(run)
        try:
            ended = streams.step()
        except Exception as e:   # the shared round: every stream's state is unknown now
            log.exception("a round failed")
            _fail(w, streams, runs, f"generation failed: {type(e).__name__}: {e}", "server")
            engine.reset()
            continue
        for run in ended:
            _end(w, engine, run, runs.pop(run))


def _admit(w: EngineWorker, engine: Engine, streams: Streams, runs: dict, job: Job) -> None:
    r = job.request
    try:
        if job.cancelled.is_set():
            w.metrics.request(r.endpoint, "cancelled")
            job.emit(Cancelled())
        elif isinstance(r, EngineCall):
            value = r.fn(engine, job.cancelled.is_set)
            w.metrics.request(r.endpoint, "ok")
            job.emit(Result(value))
        else:
            jr = JobRun(engine, job, w.metrics)
            run = streams.add(r.prompt_ids, r.max_tokens, jr.feed, sampling=r.sampling, stop_ids=r.stop_ids,
                              gen=jr.gen, spec=w.spec,
                              logprobs=r.n_logprobs, cancel=job.cancelled.is_set, constraint=r.constraint)
            runs[run] = jr
            w.slot_jobs[run.slot.id] = job
            return
    except Exception as e:   # the worker must survive anything one request does
        log.exception("a request failed")
        for slot in engine.slots:   # an engine call's slot (a free one) holds unknown rows now
            if not slot.busy:
                engine.reset_slot(slot)
        w.metrics.request(r.endpoint, "error")
        job.emit(Failed(APIError("server", f"generation failed: {type(e).__name__}: {e}")))
    with w._cond:
        w.running.discard(job)


def _end(w: EngineWorker, engine: Engine, run: StreamRun, jr: JobRun) -> None:
    job = jr.job
    if run.error is not None:
        log.error("generation failed: %r", run.error)
        engine.reset_slot(run.slot)   # its rows are unknown now: its next prompt is prefilled whole
        w.metrics.request(job.request.endpoint, "error")
        job.emit(Failed(APIError("server", f"generation failed: {type(run.error).__name__}: {run.error}")))
    else:
        jr.end()
    with w._cond:
        w.running.discard(job)


def _fail(w: EngineWorker, streams: Streams, runs: dict, message: str, kind: str) -> None:
    for run in streams.close_all():
        jr = runs.pop(run, None)
        if jr is not None:
            w.metrics.request(jr.job.request.endpoint, "error")
            jr.job.emit(Failed(APIError(kind, message)))
    with w._cond:
        w.running.clear()

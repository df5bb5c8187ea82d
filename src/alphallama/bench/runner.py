"""Runs a schedule (see schedule.py) against the arms: starts a fresh server per block
for command arms, sends every step through the one streaming client, and records one
sample per step.

A failed request is a sample with ok=False, never an exception. After a failure the
runner asks whether the server is still there (the process for a command arm, an HTTP
answer for any arm); if not, the arm's remaining steps in the block are recorded as
skipped at once rather than each waiting out a timeout. A command arm gets a fresh
server in its next block; a URL arm that went away stays skipped for the run.
"""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .arms import ArmError, ArmSpec, ServerProcess, describe, probe_versions, reachable, served_model
from .client import Measurement, request_body, stream_chat
from .schedule import Block, Step


@dataclass(frozen=True)
class RunSettings:
    temperature: float = 0.0
    seed: int | None = None
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    model: str | None = None                  # for every arm, unless arm_models names it
    arm_models: dict[str, str] = field(default_factory=dict)
    read_timeout: float = 300.0               # seconds without a byte before giving up
    startup_timeout: float = 900.0            # a command arm's server must be healthy by then
    stop_timeout: float = 15.0                # SIGTERM grace before SIGKILL
    warmup: int = 0                           # untimed requests per block and arm (a command
                                              # arm's fresh server; a URL arm's pass)
    log_dir: Path = Path("logs")


@dataclass
class _Live:
    """An arm during one block."""
    root: str
    process: ServerProcess | None = None
    dead: str | None = None


def make_http(settings: RunSettings) -> httpx.Client:
    # trust_env=False: a proxy from the environment must not sit between the client
    # and a loopback server and distort the timings.
    timeout = httpx.Timeout(connect=10.0, read=settings.read_timeout, write=30.0, pool=10.0)
    return httpx.Client(timeout=timeout, trust_env=False)


class Runner:
    def __init__(self, arms: list[ArmSpec], settings: RunSettings, http: httpx.Client,
                 progress: Any = None) -> None:
        self.arms = {a.name: a for a in arms}
        self.settings = settings
        self.http = http
        self.progress = progress
        self.samples: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []      # one record per server lifetime
        self.arm_info: dict[str, dict[str, Any]] = {a.name: describe(a) for a in arms}
        self._gone: dict[str, str] = {}              # URL arms that stopped answering

    def run(self, blocks: list[Block]) -> None:
        for block in blocks:
            self._run_block(block)

    def _run_block(self, block: Block) -> None:
        with ExitStack() as stack:
            live = {arm: self._open(arm, block, stack) for arm in block.arms}
            for step in block.steps:
                self._step(step, live[step.arm])

    def _open(self, arm: str, block: Block, stack: ExitStack) -> _Live:
        spec = self.arms[arm]
        if spec.url is not None:
            live = _Live(spec.url, dead=self._gone.get(arm))
        else:
            live = self._start(spec, block.pass_no, stack)
        if live.dead is None:
            self._identify(arm, live.root)
            self._warm(arm, live, block)
        return live

    def _start(self, spec: ArmSpec, pass_no: int, stack: ExitStack) -> _Live:
        self._describe(f"{spec.name} pass {pass_no}: starting server")
        log = self.settings.log_dir / f"{spec.name}-pass{pass_no}.log"
        record: dict[str, Any] = {"arm": spec.name, "pass": pass_no, "log": str(log),
                                  "started_at": time.time()}
        self.servers.append(record)
        try:
            proc = stack.enter_context(ServerProcess(spec, log, self.settings.stop_timeout))
            stack.callback(self._stopped, record, proc)
            record.update(port=proc.port, argv=proc.argv)
            record["startup_s"] = proc.wait_healthy(self.http, self.settings.startup_timeout)
        except ArmError as e:
            record["error"] = str(e)
            return _Live("", dead=f"server did not start: {str(e).splitlines()[0]}")
        return _Live(proc.root, process=proc)

    @staticmethod
    def _stopped(record: dict[str, Any], proc: ServerProcess) -> None:
        record["exited_during_run"] = not proc.alive()
        record["returncode"] = proc.stop()
        record["stopped_at"] = time.time()

    def _identify(self, arm: str, root: str) -> None:
        info = self.arm_info[arm]
        if "versions" not in info:   # once per arm: fresh servers of one arm are alike
            info["versions"] = probe_versions(self.http, root)
            info["model"] = (self.settings.arm_models.get(arm) or self.settings.model
                             or served_model(info["versions"]) or "default")

    def _warm(self, arm: str, live: _Live, block: Block) -> None:
        first = next(s for s in block.steps if s.arm == arm)
        for _ in range(self.settings.warmup):
            self._describe(f"{arm} pass {block.pass_no}: warm-up")
            m = stream_chat(self.http, live.root, self._body(arm, first, min(32, first.prompt.max_tokens)))
            if not m.ok:
                self._check(arm, live, m)

    def _body(self, arm: str, step: Step, max_tokens: int) -> dict[str, Any]:
        s = self.settings
        return request_body(self.arm_info[arm]["model"], step.prompt.messages, max_tokens,
                            s.temperature, s.seed, s.include_usage, s.extra_body)

    def _step(self, step: Step, live: _Live) -> None:
        self._describe(f"{step.arm} pass {step.pass_no}: {step.prompt.id}")
        started = time.time()
        if live.dead is not None:
            m = Measurement(error=f"skipped: {live.dead}")
        else:
            m = stream_chat(self.http, live.root, self._body(step.arm, step, step.prompt.max_tokens))
            if not m.ok:
                self._check(step.arm, live, m)
        self.samples.append({"arm": step.arm, "pass": step.pass_no, "order": step.order,
                             "prompt": step.prompt.id, "set": step.prompt.set,
                             "started_at": started, **asdict(m)})
        if self.progress is not None:
            rate = m.server_tps or m.client_tps
            self.progress.set_postfix_str(f"{rate:.1f} tok/s" if m.ok and rate else "error")
            self.progress.update(1)

    def _check(self, arm: str, live: _Live, m: Measurement) -> None:
        """After a failure: is the server still there?"""
        up = reachable(self.http, live.root)
        if live.process is not None and not up:
            live.process.wait_exit(2.0)   # a crashing server drops its sockets before it is reaped
        if live.process is not None and not live.process.alive():
            live.dead = live.process.exit_note()
        elif not up:
            live.dead = f"server stopped answering ({m.error})"
            if live.process is None:
                self._gone[arm] = live.dead

    def _describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.set_description_str(text)

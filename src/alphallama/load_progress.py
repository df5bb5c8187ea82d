"""What `run` and `serve` show while a model loads: reading the weights, building the
runtime (caches, CUDA graphs, the MTP head), warming up, each with its time.

A model of a few GB takes seconds to tens of seconds; silence that long looks like a
hang. On a terminal the weights get a tqdm bar (by bytes, the file's size as the
total); otherwise (a log file, a service manager's journal) each stage is one line when
it starts and one when it ends.
"""
from __future__ import annotations

import os
import sys
import time


class LoadProgress:
    def __init__(self, path: str, out=None):
        self.out = sys.stderr if out is None else out
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.name = os.path.basename(path)
        try:   # (a missing or unreadable file is Engine.load's to report, as a GGUFError)
            self.size: int | None = os.path.getsize(path)
        except OSError:
            self.size = None
        self._bar = None
        self._stage: str | None = None
        self._t0 = 0.0

    def _say(self, text: str) -> None:
        print(f"alphallama: {text}", file=self.out, flush=True)

    def begin(self, stage: str) -> None:
        """End the current stage (its time printed) and start `stage`."""
        self.end()
        self._stage, self._t0 = stage, time.perf_counter()
        self._say(f"{stage} ...")

    def weights(self) -> None:
        """Start the weights stage: a bar on a terminal, a line elsewhere."""
        self.end()
        size = f" ({self.size / 2**20:,.0f} MiB)" if self.size is not None else ""
        self._stage, self._t0 = f"reading the weights of {self.name}{size}", time.perf_counter()
        if self.tty:
            from tqdm import tqdm
            self._bar = tqdm(total=self.size, unit="B", unit_scale=True, desc=f"loading {self.name}",
                             file=self.out, leave=False)
        else:
            self._say(f"{self._stage} ...")

    def update(self, _name: str, nbytes: int) -> None:
        """Engine.load's per-tensor progress callback."""
        if self._bar is not None:
            self._bar.update(nbytes)

    def abandon(self) -> None:
        """The stage failed: clear the bar (the error line follows on a line of its own), no time."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._stage = None

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._stage is not None:
            self._say(f"{self._stage}: {time.perf_counter() - self._t0:.1f} s")
            self._stage = None

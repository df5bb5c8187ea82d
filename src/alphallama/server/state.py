"""The server's settings and the per-app state the routes reach through `request.app`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from ..config import DEFAULTS
from ..engine import Engine
from ..sampling import SamplingParams
from ..spec.config import SpecConfig
from .errors import APIError
from .metrics import Metrics
from .worker import EngineWorker


@dataclass(frozen=True)
class ServerSettings:
    model_names: tuple[str, ...]     # names a request may use; the first is reported back
    api_key: str | None = None
    n_predict: int = DEFAULTS.server.n_predict          # -1: until EOS or the context is full
    sampling: SamplingParams = SamplingParams()         # request fields override these
    spec: SpecConfig = SpecConfig()                     # requests cannot change it (exactness)
    queue_size: int = DEFAULTS.server.queue_size
    retry_after_s: int = DEFAULTS.server.retry_after_s
    max_body_bytes: int = DEFAULTS.server.max_body_bytes

    @staticmethod
    def names_for(model_path: str | None, alias: str | None = None) -> tuple[str, ...]:
        """The alias (default: the file's name), then the path as given, the file name and
        its stem, so `model="stories260K"` and `model="stories260K.gguf"` both work."""
        names = [alias] if alias else []
        if model_path:
            p = Path(model_path)
            names += [p.name, str(model_path), p.stem]
        return tuple(dict.fromkeys(names or ["alphallama"]))

    @property
    def alias(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError("not_found", f"the model {name!r} does not exist; this server serves "
                           f"{self.alias!r}", param="model", code="model_not_found")


@dataclass
class AppState:
    settings: ServerSettings
    worker: EngineWorker
    metrics: Metrics
    started: float = field(default_factory=time.time)

    def ready_engine(self) -> Engine:
        engine = self.worker.engine
        if self.worker.state != "ready" or engine is None:
            raise APIError("unavailable", self.worker.unavailable_reason())
        return engine


def app_state(request: Request) -> AppState:
    return request.app.state.alpha

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
    model_names: tuple[str, ...]     # the model's names; the first is reported back (/v1/models, responses)
    api_key: str | None = None
    n_predict: int = DEFAULTS.server.n_predict          # -1: until EOS or the context is full
    sampling: SamplingParams = SamplingParams()         # request fields override these
    spec: SpecConfig = SpecConfig()                     # requests cannot change it (exactness)
    queue_size: int = DEFAULTS.server.queue_size
    retry_after_s: int = DEFAULTS.server.retry_after_s
    max_body_bytes: int = DEFAULTS.server.max_body_bytes
    cors_origins: tuple[str, ...] = ()                  # browser origins beyond the local ones ("*": all)
    pooling: str = DEFAULTS.server.pooling              # /v1/embeddings: a key of embeddings.POOLINGS
    reasoning_format: str = DEFAULTS.server.reasoning_format   # <think> text: reasoning_content (auto) or content (none)

    @staticmethod
    def names_for(model_path: str | None, alias: str | None = None) -> tuple[str, ...]:
        """The alias (default: the file's name), then the path as given, the file name and
        its stem. Requests may name any model (they get this one, as from llama-server);
        /v1/models and the responses report the first name."""
        names = [alias] if alias else []
        if model_path:
            p = Path(model_path)
            names += [p.name, str(model_path), p.stem]
        return tuple(dict.fromkeys(names or ["alphallama"]))

    @property
    def alias(self) -> str:
        return self.model_names[0]


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

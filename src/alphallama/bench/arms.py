"""Arms: a running server's base URL, or a command that starts one.

`NAME=http://host:port` is a URL arm (the server is already up; `/v1` at the end is
optional). Anything else is a command arm: the harness picks a free loopback port,
substitutes `{port}` (and `{host}`) into the command, starts it in its own process
group with output to a log file, waits until `/health` (or, for servers without one,
`/v1/models`) answers 200, and stops the whole group afterwards: SIGTERM, then SIGKILL
after the grace period. The command runs without a shell; write
`env OLLAMA_HOST=127.0.0.1:{port} ollama serve` for servers configured by environment.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

# Endpoints that say which server and build answered, tried on every arm; a server
# that lacks one simply returns an error, which is not recorded.
VERSION_PROBES: dict[str, str] = {
    "models": "/v1/models",   # OpenAI: served model ids
    "props": "/props",        # llama-server (and ours): build info, settings
    "ollama": "/api/version",
    "version": "/version",    # vLLM
}


class ArmError(RuntimeError):
    pass


@dataclass(frozen=True)
class ArmSpec:
    name: str
    url: str | None = None     # API root of a URL arm (no trailing /v1)
    cmd: str | None = None     # command template of a command arm

    @property
    def kind(self) -> str:
        return "url" if self.url else "cmd"


def parse_arm(text: str) -> ArmSpec:
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not value:
        raise ArmError(f"arm {text!r}: expected NAME=URL or NAME=COMMAND")
    if not _NAME.match(name):
        raise ArmError(f"arm name {name!r}: use letters, digits, '_', '.', '-'")
    if value.startswith(("http://", "https://")):
        return ArmSpec(name, url=api_root(value))
    if "{port}" not in value:
        raise ArmError(f"arm {name!r}: a command arm needs a {{port}} placeholder")
    shlex.split(value)   # fail now on unbalanced quotes, not after other arms ran
    return ArmSpec(name, cmd=value)


def api_root(url: str) -> str:
    root = url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_json(http: httpx.Client, url: str, timeout: float = 3.0) -> Any | None:
    try:
        r = http.get(url, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def reachable(http: httpx.Client, root: str, timeout: float = 3.0) -> bool:
    """Does anything answer HTTP at root? (Used after a failed request.)"""
    try:
        http.get(root + "/health", timeout=timeout)
        return True
    except httpx.HTTPError:
        return False


def probe_versions(http: httpx.Client, root: str) -> dict[str, Any]:
    found = {}
    for key, path in VERSION_PROBES.items():
        doc = get_json(http, root + path)
        if doc is not None:
            found[key] = _shorten(doc)
    return found


def served_model(versions: dict[str, Any]) -> str | None:
    data = (versions.get("models") or {}).get("data") if isinstance(versions.get("models"), dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
        return str(data[0]["id"])
    return None


def _shorten(doc: Any, limit: int = 400) -> Any:
    """Keep version documents small: /props carries the whole chat template."""
    if isinstance(doc, dict):
        return {k: _shorten(v, limit) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_shorten(v, limit) for v in doc[:20]]
    if isinstance(doc, str) and len(doc) > limit:
        return doc[:limit] + f"... [{len(doc)} chars]"
    return doc


class ServerProcess:
    """One fresh server started from a command arm; use as a context manager."""

    def __init__(self, spec: ArmSpec, log_path: Path, stop_timeout: float = 15.0) -> None:
        assert spec.cmd is not None
        self.spec = spec
        self.log_path = log_path
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.argv = shlex.split(spec.cmd.replace("{port}", str(self.port)).replace("{host}", LOOPBACK))
        self.root = f"http://{LOOPBACK}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def __enter__(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {shlex.join(self.argv)}\n".encode())
            log.flush()
            try:
                # Own session = own process group, so stop() reaches the server's
                # children (wrapper scripts, workers) and nothing else.
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                raise ArmError(f"cannot start {self.argv[0]!r}: {e}") from None
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float) -> None:
        """Give a process that is going down up to `timeout` s to finish exiting."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def exit_note(self) -> str:
        rc = self.proc.poll() if self.proc else None
        return f"server exited with code {rc}; log: {self.log_path}"

    def wait_healthy(self, http: httpx.Client, timeout: float) -> float:
        """Block until the server answers healthy; return seconds waited."""
        t0 = time.monotonic()
        delay = 0.05
        while True:
            if not self.alive():
                raise ArmError(f"{self.exit_note()}\n{self.log_tail()}")
            if _healthy(http, self.root):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise ArmError(f"not healthy after {timeout:.0f}s; log: {self.log_path}")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def stop(self) -> int | None:
        if self.proc is None or self.returncode is not None:
            return self.returncode
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
            # The next arm's server needs the GPU memory of every process in the
            # group, not only the leader's: wait for the group, then force it.
            self._wait_group(time.monotonic() + self.stop_timeout)
        self._signal(signal.SIGKILL)
        self.returncode = self.proc.wait()
        return self.returncode

    def _wait_group(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)     # signal 0: does the group still exist?
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _healthy(http: httpx.Client, root: str) -> bool:
    try:
        r = http.get(root + "/health", timeout=2.0)
        if r.status_code == 200:
            return True
        if r.status_code == 404:    # no /health (Ollama, some proxies): ask for models
            return http.get(root + "/v1/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        pass
    return False


def describe(spec: ArmSpec) -> dict[str, Any]:
    return {"name": spec.name, "kind": spec.kind, "url": spec.url, "cmd": spec.cmd}

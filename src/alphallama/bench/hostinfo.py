"""The state of the box a result was measured on (DESIGN §8.5): GPU name, clocks,
driver and PCIe link; CPU; library versions; the git commit; the command line.
Every probe is best-effort: a missing tool leaves a note, never an exception."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# Report key -> nvidia-smi --query-gpu field. Clocks are read at the start and at the
# end of a run, so a card that throttled during the session shows it.
GPU_FIELDS: dict[str, str] = {
    "index": "index",
    "name": "name",
    "uuid": "uuid",
    "driver": "driver_version",
    "vbios": "vbios_version",
    "memory_total_mib": "memory.total",
    "memory_used_mib": "memory.used",
    "sm_clock_mhz": "clocks.sm",
    "mem_clock_mhz": "clocks.mem",
    "sm_clock_max_mhz": "clocks.max.sm",
    "mem_clock_max_mhz": "clocks.max.mem",
    "pcie_gen": "pcie.link.gen.current",
    "pcie_gen_max": "pcie.link.gen.max",
    "pcie_width": "pcie.link.width.current",
    "pcie_width_max": "pcie.link.width.max",
    "temperature_c": "temperature.gpu",
    "power_w": "power.draw",
    "power_limit_w": "power.limit",
    "pstate": "pstate",
    "persistence_mode": "persistence_mode",
}

PACKAGES = ("alphallama", "torch", "triton", "httpx", "gguf")


def _run(argv: list[str], cwd: str | None = None, timeout: float = 10.0) -> str | None:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu_state() -> dict[str, Any]:
    if shutil.which("nvidia-smi") is None:
        return {"gpus": [], "note": "nvidia-smi not found"}
    query = ",".join(GPU_FIELDS.values())
    out = _run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"])
    if out is None:
        return {"gpus": [], "note": "nvidia-smi query failed"}
    gpus = []
    for line in out.splitlines():
        values = [v.strip() for v in line.split(",")]
        gpus.append({k: _number(v) for k, v in zip(GPU_FIELDS, values)})
    return {"gpus": gpus}


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)   # no import: torch takes seconds to load
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_state(cwd: str) -> dict[str, Any]:
    commit = _run(["git", "rev-parse", "HEAD"], cwd)
    if commit is None:
        return {"commit": None, "note": "not a git checkout"}
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd)
    return {"commit": commit, "dirty": bool(status),
            "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd)}


def host_state(argv: list[str] | None = None, cwd: str | None = None) -> dict[str, Any]:
    cwd = cwd or os.getcwd()
    argv = sys.argv if argv is None else argv
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(argv),
        "cwd": cwd,
        "git": git_state(cwd),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "cpu": cpu_model(), "cpus": os.cpu_count(), "mem_gib": mem_total_gib()},
        "versions": versions(),
        "gpu": gpu_state(),
    }

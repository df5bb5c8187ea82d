"""The arena prompt suite: one JSON object per line with `id`, `set`, `category`,
`messages` (sent as they are) and `max_tokens`.

The public suite ships inside the package, so `alphallama bench` runs from an
installed wheel without the project's shared folder.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

PUBLIC_SUITE = "arena-public.jsonl"
# Known sets, in report order; a custom suite may add others (reported after these).
SET_ORDER = ("A", "V", "R")


class SuiteError(ValueError):
    pass


@dataclass(frozen=True)
class Prompt:
    id: str
    set: str
    category: str
    messages: tuple[dict[str, Any], ...]
    max_tokens: int


@dataclass(frozen=True)
class Suite:
    source: str            # file path, or "package:<name>" for the shipped suite
    sha256: str            # of the file's bytes, so a result names its exact workload
    prompts: tuple[Prompt, ...]

    def sets(self) -> list[str]:
        return ordered_sets(p.set for p in self.prompts)


def ordered_sets(names) -> list[str]:
    seen = list(dict.fromkeys(names))
    known = [s for s in SET_ORDER if s in seen]
    return known + [s for s in seen if s not in SET_ORDER]


def load_suite(path: str | Path | None = None) -> Suite:
    """Read a suite file; None means the public suite shipped with the package."""
    if path is None:
        data = resources.files(__package__).joinpath("suites", PUBLIC_SUITE).read_bytes()
        source = f"package:{PUBLIC_SUITE}"
    else:
        data = Path(path).read_bytes()
        source = str(path)
    return Suite(source, hashlib.sha256(data).hexdigest(), parse_prompts(data.decode("utf-8"), source))


def parse_prompts(text: str, source: str = "<suite>") -> tuple[Prompt, ...]:
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SuiteError(f"{where}: not JSON ({e})") from None
        prompt = _prompt_from(obj, where)
        if prompt.id in seen:
            raise SuiteError(f"{where}: duplicate id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise SuiteError(f"{source}: no prompts")
    return tuple(prompts)


def _prompt_from(obj: Any, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise SuiteError(f"{where}: expected a JSON object")
    for key in ("id", "set", "messages", "max_tokens"):
        if key not in obj:
            raise SuiteError(f"{where}: missing {key!r}")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise SuiteError(f"{where}: messages must be a non-empty list of objects")
    max_tokens = obj["max_tokens"]
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SuiteError(f"{where}: max_tokens must be a positive integer")
    return Prompt(str(obj["id"]), str(obj["set"]), str(obj.get("category", "")),
                  tuple(messages), max_tokens)


def select(suite: Suite, sets: list[str] | None = None, prompts: str | None = None,
           max_tokens_scale: float = 1.0) -> Suite:
    """Narrow a suite for a quick run.

    sets: keep only these sets. prompts: either comma-separated ids ("A01,R03") or a
    number N meaning the first N prompts of each kept set. max_tokens_scale: multiply
    every token budget (rounded, at least 2 so a client-clock rate exists).
    """
    chosen = list(suite.prompts)
    if sets:
        unknown = set(sets) - {p.set for p in chosen}
        if unknown:
            raise SuiteError(f"no prompts in set(s) {sorted(unknown)}")
        chosen = [p for p in chosen if p.set in sets]
    if prompts:
        chosen = _pick(chosen, prompts)
    if max_tokens_scale <= 0:
        raise SuiteError("--max-tokens-scale must be positive")
    if max_tokens_scale != 1.0:
        chosen = [replace(p, max_tokens=max(2, round(p.max_tokens * max_tokens_scale))) for p in chosen]
    if not chosen:
        raise SuiteError("the selection is empty")
    return replace(suite, prompts=tuple(chosen))


def _pick(chosen: list[Prompt], spec: str) -> list[Prompt]:
    spec = spec.strip()
    if spec.isdigit():
        limit, taken, kept = int(spec), {}, []
        for p in chosen:
            taken[p.set] = taken.get(p.set, 0) + 1
            if taken[p.set] <= limit:
                kept.append(p)
        return kept
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    by_id = {p.id: p for p in chosen}
    missing = [w for w in wanted if w not in by_id]
    if missing:
        raise SuiteError(f"unknown prompt id(s) {missing}")
    # Keep suite order, not the order typed, so pass 1 is always the suite's order.
    return [p for p in chosen if p.id in set(wanted)]

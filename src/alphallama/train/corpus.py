"""The Python-source corpus: the interpreter's standard library and site-packages,
deduplicated by content, minus the packages the benchmark prompts are made of, with a
manifest of every file and its hash, and a held-out split chosen by hash.

    roots = default_roots()                          # [(label, Path)], site-packages first
    files = collect(roots, max_bytes=200 << 20)      # list[SourceFile], deduplicated
    train = [f for f in files if not f.held_out]
    sha = write_manifest(files, "manifest.tsv.gz")   # sha256 of the manifest file

A file is held out when its content hash says so (`held_out(sha256, fraction)`), decided
before anything is trained: held-out files never enter training, neither raw nor inside
instruction examples.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import site
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..config import DEFAULTS

# directory names never descended into below a root: caches, and site-packages seen from
# the stdlib root (walked separately, under its own label)
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", ".git"})


@dataclass(frozen=True)
class SourceFile:
    path: str          # "<root label>/<path below the root>"
    sha256: str        # of the UTF-8 bytes
    text: str
    held_out: bool

    @property
    def size(self) -> int:
        return len(self.text.encode())


def default_roots() -> list[tuple[str, Path]]:
    """This interpreter's site-packages directories, then its standard library."""
    roots: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    paths = sysconfig.get_paths()
    sp = [paths.get("purelib"), paths.get("platlib")]
    try:
        sp += site.getsitepackages()
    except AttributeError:   # some virtualenvs lack it
        pass
    for i, p in enumerate(sp):
        if p and Path(p).is_dir() and Path(p).resolve() not in seen:
            seen.add(Path(p).resolve())
            roots.append((f"site{i}", Path(p)))
    roots.append(("stdlib", Path(paths["stdlib"])))
    return roots


def held_out(sha256: str, fraction: float) -> bool:
    """Deterministic split by content hash: the first 32 bits as a fraction of 2**32."""
    return int(sha256[:8], 16) < fraction * 2**32


def excluded(rel: Path, names: frozenset[str]) -> bool:
    """Does this path belong to an excluded package? Any directory component named so
    (vendored copies too), or a top-level module file `<name>.py`."""
    parts = [p.lower() for p in rel.parts]
    return any(p in names for p in parts[:-1]) or (len(parts) == 1 and parts[0][:-3] in names)


def _walk(label: str, root: Path, names: frozenset[str]) -> list[tuple[str, Path, int]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".dist-info"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            full = Path(dirpath) / fn
            rel = full.relative_to(root)
            if excluded(rel, names):
                continue
            try:
                size = full.stat().st_size
            except OSError:
                continue
            out.append((f"{label}/{rel.as_posix()}", full, size))
    return out


def _read(full: Path, max_line: int) -> str | None:
    try:
        text = full.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text or any(len(line) > max_line for line in text.splitlines()):
        return None   # data blobs and minified code teach nothing
    return text


def collect(roots: list[tuple[str, Path]], *, max_bytes: int | None = None,
            exclude: tuple[str, ...] = DEFAULTS.train.exclude_packages,
            held_out_fraction: float = DEFAULTS.train.held_out_fraction,
            min_file_bytes: int = 64, max_file_bytes: int = 256 << 10, max_line: int = 400,
            threads: int = 16) -> list[SourceFile]:
    """Every .py file under the roots (excluded packages skipped), deduplicated by
    content (the first path in walk order keeps it), UTF-8 only.

    With max_bytes, files are taken in an order fixed by the hash of their path (a
    spread over all packages) until the sizes reach max_bytes; the standard library
    (the last root) is always taken whole first."""
    names = frozenset(n.lower() for n in exclude)
    listed = [_walk(label, root, names) for label, root in roots]
    stdlib, rest = listed[-1], [x for part in listed[:-1] for x in part]
    rest.sort(key=lambda x: hashlib.sha256(x[0].encode()).digest())
    chosen, total = [], 0
    for rel, full, size in stdlib + rest:
        if not min_file_bytes <= size <= max_file_bytes:
            continue
        if max_bytes is not None and total + size > max_bytes:
            continue
        chosen.append((rel, full))
        total += size
    with ThreadPoolExecutor(threads) as pool:
        texts = list(pool.map(lambda x: _read(x[1], max_line), chosen))
    files, seen = [], set()
    for (rel, _), text in zip(chosen, texts):
        if text is None or not text.strip():
            continue
        sha = hashlib.sha256(text.encode()).hexdigest()
        if sha in seen:
            continue
        seen.add(sha)
        files.append(SourceFile(rel, sha, text, held_out(sha, held_out_fraction)))
    return files


def write_manifest(files: list[SourceFile], path: str | Path) -> str:
    """A gzipped TSV (sha256, bytes, split, path), one line per file; returns the sha256
    of the gzipped file (mtime 0, so the same corpus gives the same bytes)."""
    lines = ["sha256\tbytes\tsplit\tpath"]
    lines += [f"{f.sha256}\t{f.size}\t{'heldout' if f.held_out else 'train'}\t{f.path}" for f in files]
    data = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    Path(path).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def read_manifest(path: str | Path) -> list[dict]:
    rows = gzip.decompress(Path(path).read_bytes()).decode().splitlines()
    head = rows[0].split("\t")
    return [dict(zip(head, r.split("\t"))) for r in rows[1:]]

"""Directories only their owner can write, and files loaded from them only when provably
ours: the native library cache, the NVRTC cubin cache and training checkpoints.

Anything loaded back from disk as code (a compiled .so, a cubin) or as trusted state (a
training checkpoint) is only as safe as the directory it sits in: a world-writable /tmp
path or a cache another user can write lets them plant a file we later execute or
deserialize. Neutral ground: offload/native and kernels/cuda both use it.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path


class UnsafePathError(PermissionError):
    """A path that someone other than its user could have written."""


def writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def private_dir(path: str | os.PathLike, owner: int | None = None) -> Path:
    """`path` as a directory of `owner` (default: this process's user) that only they can
    enter, created 0700 if missing. A symlink, a non-directory or another user's
    directory is refused; one of ours that is open to others is tightened to 0700.
    `owner` is a parameter so the refusal can be tested without a second account."""
    owner = os.geteuid() if owner is None else owner
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        p.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{p} is not a plain directory (a symlink or a file): refusing to use it")
    if st.st_uid != owner:
        raise UnsafePathError(f"{p} belongs to uid {st.st_uid}, not to this user (uid {owner}): refusing to use it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(p, 0o700)
    return p


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "alphallama"


def read_json(path: Path) -> dict:
    """A cache's JSON object, {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    """Write a cache's JSON object whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def digest_path(so: Path) -> Path:
    """The sidecar holding the library's sha256, recorded when it was built."""
    return so.with_name(so.name + ".sha256")


def _open_private(path: Path, owner: int) -> int:
    """An fd on `path` if it is a regular file of `owner` that no one else can write
    (checked on the open fd, so the file cannot be swapped between check and use)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)   # a symlink: OSError (ELOOP)
    st = os.fstat(fd)
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file"
    elif st.st_uid != owner:
        why = f"belongs to uid {st.st_uid}, not {owner}"
    elif writable_by_others(st.st_mode):
        why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        os.close(fd)
        raise UnsafePathError(f"{path} {why}")
    return fd


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def open_trusted(so: Path, owner: int | None = None) -> tuple[int | None, str]:
    """(an fd to dlopen, "") if the cached library is `owner`'s, private, and its content
    hash matches the sidecar (also `owner`'s and private); else (None, why not).
    `owner` defaults to this process's user; tests pass another to check the refusal."""
    owner = os.geteuid() if owner is None else owner
    try:
        fd = _open_private(digest_path(so), owner)
        try:
            recorded = os.read(fd, 256).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        fd = _open_private(so, owner)
    except FileNotFoundError as e:
        return None, f"{e.filename} is missing"
    except OSError as e:   # UnsafePathError, a symlink, unreadable
        return None, str(e)
    actual = _sha256_fd(fd)
    if actual != recorded:
        os.close(fd)
        return None, f"{so} has sha256 {actual[:16]}..., not the {recorded[:16]}... recorded when it was built"
    return fd, ""

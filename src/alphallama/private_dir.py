"""Directories only their owner can write: the native library cache and training checkpoints.

Anything loaded back from disk as code (a compiled .so) or as trusted state (a training
checkpoint) is only as safe as the directory it sits in: a world-writable /tmp path or
a cache another user can write lets them plant a file we later execute or deserialize.
"""
from __future__ import annotations

import os
import stat
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

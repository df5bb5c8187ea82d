"""The native expert library is dlopen'ed from the cache only when it is provably the
user's own build: private directory, the user's file, not group/other-writable, and the
sha256 recorded at build time. Each refusal is checked, and that a refused file is
rebuilt rather than loaded."""
from __future__ import annotations

import hashlib
import os
import re
import stat

import pytest

from alphallama.offload.native import build
from alphallama.private_dir import UnsafePathError, private_dir

OTHER_UID = 4242


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One build for the module (a compile takes seconds on a shared CPU)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("native-cache")))
        so = build.build()
    return so, so.read_bytes(), build.digest_path(so).read_bytes()


@pytest.fixture
def cache(built, tmp_path, monkeypatch):
    """This test's own cache holding that build, as build() leaves it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first, lib, digest = built
    so = build.library_path(build.find_compiler())
    assert so.name == first.name
    so.parent.mkdir(parents=True, mode=0o700)
    so.write_bytes(lib)
    os.chmod(so, 0o755)
    build.digest_path(so).write_bytes(digest)
    return so


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_records_the_hash_in_a_private_directory(built):
    so = built[0]
    assert stat.S_IMODE(so.parent.stat().st_mode) == 0o700
    assert build.digest_path(so).read_text().strip() == _sha(so)
    assert not stat.S_IMODE(so.stat().st_mode) & 0o022
    fd, why = build.open_trusted(so)
    assert why == "" and fd is not None
    os.close(fd)


def _tamper(so):
    with open(so, "ab") as fh:
        fh.write(b"\0planted")


REFUSALS = {
    "another user's file": (lambda so: None, {"owner": OTHER_UID}, f"belongs to uid {os.geteuid()}, not {OTHER_UID}"),
    "group-writable": (lambda so: os.chmod(so, 0o775), {}, "writable by group or others"),
    "other-writable": (lambda so: os.chmod(so, 0o757), {}, "writable by group or others"),
    "content changed": (_tamper, {}, "not the .* recorded when it was built"),
    "no recorded hash": (lambda so: build.digest_path(so).unlink(), {}, r"\.sha256 is missing"),
    "hash sidecar writable": (lambda so: os.chmod(build.digest_path(so), 0o666), {}, r"\.sha256 is writable"),
    "symlink": (lambda so: (os.replace(so, so.with_suffix(".real")), os.symlink(so.with_suffix(".real"), so)), {},
                "symbolic links|Too many levels"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_each_refusal(cache, case):
    spoil, kw, why = REFUSALS[case]
    spoil(cache)
    fd, reason = build.open_trusted(cache, **kw)
    assert fd is None
    assert re.search(why, reason), reason


@pytest.mark.parametrize("which", ["library", "hash sidecar"])
def test_a_file_chowned_to_another_user_is_refused(cache, which):
    """The real thing where we can make it (root): each file checked on its own."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root (the uid check itself is covered above)")
    target = cache if which == "library" else build.digest_path(cache)
    os.chown(target, OTHER_UID, -1)
    fd, reason = build.open_trusted(cache)
    assert fd is None and reason == f"{target} belongs to uid {OTHER_UID}, not 0"


@pytest.mark.parametrize("spoil", ["tamper", "chmod", "chown"])
def test_a_refused_library_is_rebuilt_not_loaded(cache, spoil):
    if spoil == "tamper":
        _tamper(cache)
    elif spoil == "chmod":
        os.chmod(cache, 0o777)
    elif os.geteuid() == 0:
        os.chown(cache, OTHER_UID, -1)
    else:   # without root there is no other user's file to make: the check itself is covered above
        pytest.skip("chown needs root")
    bad_bytes, bad_inode = cache.read_bytes(), cache.stat().st_ino
    so = build.load()
    st = cache.stat()
    assert st.st_ino != bad_inode   # a new file took its place
    assert st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022
    assert build.digest_path(cache).read_text().strip() == _sha(cache)
    if spoil == "tamper":
        assert cache.read_bytes() != bad_bytes
    assert so.aq_current_cpu() >= 0   # the rebuilt library is the one loaded, and it works


def test_the_cache_directory_must_be_ours(tmp_path):
    d = tmp_path / "native"
    assert private_dir(d) == d and stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o777)
    private_dir(d)   # ours but open: tightened
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    with pytest.raises(UnsafePathError, match=f"belongs to uid {os.geteuid()}, not to this user"):
        private_dir(d, owner=OTHER_UID)
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(UnsafePathError, match="not a plain directory"):
        private_dir(tmp_path / "link")


def test_an_unsafe_cache_directory_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "alphallama").mkdir()
    (tmp_path / "alphallama" / "native").symlink_to(tmp_path)
    with pytest.raises(build.NativeBuildError, match="cache is unsafe: .* not a plain directory"):
        build.load()

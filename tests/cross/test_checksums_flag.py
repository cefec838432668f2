"""One flag skips the sha256 checks in every command (doel.contracts.checksums.FLAG): doel-train's
fit and sft, doel-export and doel-serve take --no-checksums, and each refuses the old spelling
--no-verify in one line naming the new one ("verify" is doel-train's correctness suite)."""

from __future__ import annotations

import pytest

from doel.contracts.checksums import FLAG, OLD_FLAG
from doel.export.cli import build_parser as export_parser
from doel.serve.cli import build_parser as serve_parser
from doel.train.cli import build_parser as train_parser

COMMANDS = {
    "doel-train fit": (train_parser, ["fit", "--config", "tiny", "--data", "d", "--out", "o"]),
    "doel-train sft": (
        train_parser,
        ["sft", "--config", "tiny", "--data", "d", "--from", "b", "--out", "o"],
    ),
    "doel-export": (export_parser, ["ckpt", "--out", "bundle"]),
    "doel-serve": (serve_parser, ["bundle"]),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_takes_no_checksums_and_refuses_no_verify_naming_it(name, capsys):
    build, argv = COMMANDS[name]
    assert build().parse_args([*argv, FLAG]).no_checksums
    assert not build().parse_args(argv).no_checksums
    with pytest.raises(SystemExit) as e:
        build().parse_args([*argv, OLD_FLAG])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: {OLD_FLAG} is now {FLAG}"), err
    sub = argv[:1] if name.startswith("doel-train") else []
    with pytest.raises(SystemExit):
        build().parse_args([*sub, "--help"])
    shown = capsys.readouterr().out
    assert FLAG in shown and OLD_FLAG not in shown

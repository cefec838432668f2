"""Help that says what the code does: every default a flag's help names is the one the parser (or,
for a flag that sets a config field, the config) holds; `doel-train tokenizer --style` names the
config's default and the styles the trainer has; `doel-export --format`'s help names exactly the
styles whose tokenizers the GGUF export takes (each trained here, each tried on the export's own
check); and the sft command the demo prints runs, doing what the demo did."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    spec = importlib.util.spec_from_file_location("docs_cli_hook", ROOT / "docs/hooks/cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parsers()


def _help(parser: argparse.ArgumentParser, flag: str) -> str:
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(parser._get_formatter()._expand_help(action).split())


def _sub(name: str) -> argparse.ArgumentParser:
    return dict(_parsers())[name]


UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def named_defaults(text: str) -> list:
    """The defaults a help text names: "default 4096", "default: 1 MiB" (numbers), "default
    ~/x", "default 127.0.0.1" and "NAME (default)" (words); one in words ("the config's"),
    none."""
    found: list = re.findall(r"([\w.-]+) \(default\)", text)
    for token, unit in re.findall(r"default:? ([~\d][\w./-]*)(?: (KiB|MiB|GiB))?", text):
        token = token.rstrip(".")
        if token.startswith("~"):
            found.append(str(Path(token).expanduser()))
        elif re.fullmatch(r"\d+(\.\d+)?(e-?\d+)?", token):
            found.append(float(token) * UNITS[unit])
        else:
            found.append(token)
    return found


def test_every_default_a_help_names_is_the_parsers():
    """A flag with a default of its own (a number, a word, a path) whose help names a default
    names that one, as argparse renders the help."""
    wrong, checked = [], 0
    for name, parser in _parsers():
        for a in parser._actions:
            default = a.default
            if not a.help or isinstance(default, bool) or default == argparse.SUPPRESS:
                continue
            if not isinstance(default, (int, float, str)):
                continue
            for said in named_defaults(parser._get_formatter()._expand_help(a)):
                checked += 1
                number = isinstance(said, float) and not isinstance(default, str)
                if not (said == float(default) if number else said == str(default)):
                    wrong.append(f"{name} {a.option_strings}: {default!r}, help says {said!r}")
    assert wrong == [] and checked > 10


def test_doel_train_tokenizer_help_names_the_configs_defaults_and_the_trainers_styles():
    from doel.train import cli
    from doel.train.data.tokenizer import STYLES, TokenizerConfig

    cfg = TokenizerConfig()
    assert cli.TOKENIZER_DEFAULTS == {"vocab_size": cfg.vocab_size, "style": cfg.style}
    assert sorted(cli.STYLES) == sorted(STYLES)
    parser = _sub("doel-train tokenizer")
    style = _help(parser, "--style")
    assert re.findall(r"(\S+) \(default\)", style) == [cfg.style]
    assert all(s in style for s in STYLES)
    assert _help(parser, "--vocab-size") == f"default {cfg.vocab_size}"


@pytest.mark.slow
def test_doel_export_format_help_names_the_styles_the_gguf_export_takes(tmp_path, sample_paths):
    """Each style's tokenizer, trained on the sample, tried on the GGUF export's own check: the
    help's `--style X` names are exactly the ones it takes."""
    pytest.importorskip("gguf")
    from doel.export.common import ExportError
    from doel.export.gguf import llama_cpp_pre_type
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import (
        STYLES,
        TokenizerConfig,
        smallest_vocab,
        train_tokenizer,
    )

    taken = set()
    for style in STYLES:
        cfg = TokenizerConfig(vocab_size=smallest_vocab(style) + 64, min_frequency=1, style=style)
        path = train_tokenizer(resolve_sources(sample_paths), cfg, tmp_path / style, progress=False)
        try:
            llama_cpp_pre_type(__import__("json").loads(path.read_text("utf-8")), path)
            taken.add(style)
        except ExportError:
            pass
    named = set(re.findall(r"`--style (\S+?)`", _help(_sub("doel-export"), "--format")))
    assert named == taken and taken  # spm and gguf, as the code stands


def test_doel_export_web_help_names_what_runs_the_page():
    """The page runs doel's own WebAssembly kernel where it can (export/web_kernel.py writes
    it), onnxruntime-web otherwise and on WebGPU."""
    from doel.export import web

    assert importlib.util.find_spec("doel.export.web_kernel") is not None
    assert "doel's kernel" in web.__doc__ and "onnxruntime-web" in web.__doc__
    text = _help(_sub("doel-export"), "--web")
    assert "doel's own 4-bit kernel" in text and "onnxruntime-web" in text
    assert "WebGPU" in text and "WebAssembly" in text


def test_the_sft_command_the_demo_prints_runs_as_the_demo_did(tmp_path, monkeypatch, capsys):
    """The demo's printed `doel-train sft ...`, run through doel-train's own parser and command,
    calls sft with the demo's settings, data, base model and folder."""
    import doel.pipeline.demo as demo
    import doel.train.sft
    from doel.train.cli import main

    calls = []

    def fake(cfg, data, base, out, **_kw):
        calls.append((cfg, [str(d) for d in data], str(base), str(out)))
        return Path(out) / "final"

    monkeypatch.setattr(demo, "sft", fake)
    monkeypatch.setattr(doel.train.sft, "sft", fake)
    demo.chat_demo(tmp_path / "run" / "final", tmp_path / "chat", "tiny", ("seed=7",))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("chat: "))
    command = line.removeprefix("chat: ").removesuffix(" (loss on the replies only)")
    argv = shlex.split(command)
    assert argv[:2] == ["doel-train", "sft"]
    main(argv[1:])
    assert len(calls) == 2 and calls[0] == calls[1]

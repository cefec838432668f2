"""MkDocs hook: docs/cli.md rendered from the four command lines' own argparse parsers at build
time, so the reference cannot drift from `--help`. tests/cross/test_docs.py walks the same
parsers and fails on a subcommand without a description or a flag without help."""

from __future__ import annotations

import argparse
import importlib

from mkdocs.structure.files import File

COMMANDS = [  # (command, module whose build_parser() makes its parser)
    ("doel", "doel.pipeline.cli"),
    ("doel-train", "doel.train.cli"),
    ("doel-export", "doel.export.cli"),
    ("doel-serve", "doel.serve.cli"),
]


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser a user meets: each command, then each of its subcommands, as (name, parser).
    A subcommand that only says where it moved (add_help=False) is left out."""
    out = []
    for name, module in COMMANDS:
        parser = importlib.import_module(module).build_parser()
        out.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    if p.add_help:
                        out.append((f"{name} {sub}", p))
    return out


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            names += f" `{action.metavar or action.dest.upper()}`"
        return names
    return f"`{action.metavar or action.dest.upper()}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render() -> str:
    lines = [
        "# Command-line reference",
        "",
        "Generated from the parsers when the site is built (`docs/hooks/cli.py`): what",
        "`--help` says, every subcommand and every flag.",
        "",
    ]
    for name, parser in parsers():
        lines += [f"## `{name}`", ""]
        if parser.description:
            lines += [_cell(parser.description), ""]
        usage = parser.format_usage().removeprefix("usage: ").strip()
        lines += ["```text", usage, "```", ""]
        rows = []
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if action.help == argparse.SUPPRESS:
                continue
            default = action.default
            shown = "" if default in (None, False, [], argparse.SUPPRESS) else f"`{default}`"
            rows.append(f"| {_flags(action)} | {_cell(action.help or '')} | {shown} |")
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            lines += ["| subcommand | what it does |", "|---|---|"]
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                shown = f"`{choice.dest}`"
                if sub.add_help:  # a moved one (add_help=False) has no section of its own
                    shown = f"[{shown}](#{_slug(f'{name} {choice.dest}')})"
                lines.append(f"| {shown} | {_cell(choice.help)} |")
            lines.append("")
        if rows:
            lines += ["| argument | what it does | default |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _slug(heading: str) -> str:
    return "-".join(heading.lower().replace("`", "").split())


def on_files(files, config):
    files.append(File.generated(config, "cli.md", content=render()))
    return files

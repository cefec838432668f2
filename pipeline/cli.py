"""`doel` (or `python -m doel.pipeline`): the commands that use every stage, the demo and the
rented-GPU recipe. Each stage's own commands are `doel-train`, `doel-export`, `doel-serve`.
"""

from __future__ import annotations

import argparse

from doel.train.cli import run_command  # standard library only at import

EXTRA_HINT = "pip install 'doel[train,export,serve]'"


def _cmd_demo(args) -> None:
    from doel.pipeline.demo import run_demo

    run_demo(args.out, args.vocab_size, args.config, args.set, args.serve, args.port)


def _cmd_recipe(args) -> None:
    from doel.pipeline.runner import main as recipe_main

    recipe_main(args)


def _recipe_args(p: argparse.ArgumentParser) -> None:
    """`doel recipe`'s options (pipeline/runner.py's `main` takes the parsed ones)."""
    from doel.pipeline.order import STAGES  # standard library only at import

    p.add_argument("recipe", nargs="?", default="bangla-0.4b", help="name, folder or TOML")
    p.add_argument("--dry-run", action="store_true", help="tiny, on this CPU, local files")
    p.add_argument("--yes", action="store_true", help="train without asking (needed without a tty)")
    p.add_argument("--price-per-hour", type=float, help="dollars a GPU-hour (default the recipe's)")
    p.add_argument("--out", help="run folder (default out/NAME or out/NAME-dry-run)")
    p.add_argument("--gpus", type=int, help="GPUs a node (default all visible; >1: torchrun)")
    p.add_argument("--nodes", type=int, default=1, help="machines training spans (c10d)")
    p.add_argument("--node-rank", type=int, help="this machine's; 0: the first (default all here)")
    p.add_argument("--master-addr", default="127.0.0.1", help="the first node's address")
    p.add_argument("--master-port", type=int, help="its rendezvous port (default 29400)")
    p.add_argument("--local", nargs="+", default=[], metavar="NAME=PATH", help="a source's file")
    p.add_argument("--eval-dir", help="the task files' folder (default the recipe's task_dir)")
    p.add_argument("--until", default="summary", choices=STAGES, help="stop after this stage")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe field")
    p.add_argument("--gpu-slice", action="store_true", help="time the real config (needs CUDA)")
    p.add_argument("--slice-seconds", type=float, default=600.0, help="timed seconds of the slice")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="doel", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser(
        "demo",
        help="the main job on the built-in sample corpus",
        description=(
            "The whole path on the built-in Bangla + English sample, on this CPU: tokenizer, "
            "fertility report, shards, gradient-flow gate, training of the demo model, held- "
            "out bits/character, samples, chat fine-tuning, an int4 bundle of each model, "
            "each served on 127.0.0.1 with one request printed. Everything lands in --out."
        ),
    )
    d.add_argument("--out", default="out/demo", help="folder for every output (default out/demo)")
    d.add_argument("--vocab-size", type=int, default=None, help="default 2048")
    d.add_argument("--config", default="demo", help="training preset or TOML (default demo)")
    d.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a training setting, e.g. steps=200 (repeat it)",
    )
    d.add_argument(
        "--serve", action="store_true", help="keep serving the bundle at the end until Ctrl-C"
    )
    d.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    d.set_defaults(func=_cmd_demo)

    rc = sub.add_parser(
        "recipe",
        help="a whole recipe: data -> model -> bundles, cost up front",
        description=(
            "Run a recipe from an empty machine to served bundles: data, tokenizer, shards, "
            "verify, train, eval, sft, export, summary. Before training it measures a few "
            "steps and asks, showing the projected hours and dollars; a rerun skips finished "
            "stages and resumes the others. --dry-run runs the same stages tiny, on this CPU, "
            "from local files."
        ),
    )
    _recipe_args(rc)
    rc.set_defaults(func=_cmd_recipe)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_command(args, f"doel {args.command} needs the {{name!r}} package: {EXTRA_HINT}")

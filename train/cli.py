"""`doel-train` (or `python -m doel.train`): a thin command line over train's functions.

Commands: tokenizer, fertility, prepare, fit, sft, check-gradients, verify, eval, plot, import,
adapt (the
demo and the recipe, which use every stage, are `doel demo` and `doel recipe`). Heavy imports
happen inside each command, so a missing extra is reported with the `pip install` line that
fixes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from doel.contracts.checksums import add_flag
from doel.train.cliparse import Parser, tokenizer_path
from doel.train.common import DoelError, Interrupted  # standard library only

EXTRA_HINT = "pip install 'doel[train]'"
# TokenizerConfig's defaults and train/data/tokenizer.py's STYLES, written here so that --help
# needs no extra (tests/cross/test_help_is_true.py holds them equal to the code's).
TOKENIZER_DEFAULTS = {"vocab_size": 32768, "style": "spm"}
STYLES = ("spm", "gguf", "doel", "doel-bytelevel", "marks-bytelevel", "gpt2")


def _cmd_tokenizer(args) -> None:
    from doel.train.config import load_config
    from doel.train.data.prepare import parse_weights
    from doel.train.data.textio import resolve_sources
    from doel.train.data.tokenizer import TokenizerConfig, train_tokenizer

    sets = list(args.set)
    if args.vocab_size is not None:
        sets.append(f"vocab_size={args.vocab_size}")
    if args.style is not None:
        sets.append(f"style={args.style}")
    cfg = load_config(TokenizerConfig, args.config, sets)
    sources = resolve_sources(args.data)
    path = train_tokenizer(
        sources, cfg, args.out, parse_weights(args.weights, sources), progress=not args.quiet
    )
    print(f"wrote {path}")


def _cmd_fertility(args) -> None:
    from doel.train.data.fertility import fertility, format_report, load_any
    from doel.train.data.textio import iter_source, resolve_sources, with_field_fix

    tok = load_any(args.tokenizer, args.pattern)
    texts = (d for src in resolve_sources(args.text) for d in iter_source(src, args.text_field))
    texts = with_field_fix(texts, "name the field with --text-field NAME")
    report = fertility(tok, texts)
    if not report:  # an empty table that exits 0 reads as a measurement (issue 38)
        raise DoelError(
            f"{' '.join(args.text)}: no text to measure (empty, or no documents in it); "
            "pass a text with some characters"
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(args.tokenizer, report))


def _cmd_prepare(args) -> None:
    from doel.train.config import load_config
    from doel.train.data.prepare import PrepareConfig, prepare

    sets = list(args.set)
    if args.val_fraction is not None:
        sets.append(f"val_fraction={args.val_fraction}")
    cfg = load_config(PrepareConfig, args.config, sets)
    prepare(
        args.tokenizer,
        args.data,
        args.out,
        cfg,
        args.weights,
        args.val or (),
        progress=not args.quiet,
        resume=not args.fresh,
    )


def train_config(args):
    """The run's TrainConfig from --config and --set, validated before torch is imported.
    Without --config, `fit` takes the config its run folder recorded (a resume); nothing else
    has a default: a preset's model would be trained silently, whatever the tokenizer."""
    from pathlib import Path

    from doel.train.config import load_config, presets, resolve_config
    from doel.train.settings import TrainConfig

    sets = list(args.set)
    for flag, key in (("steps", "steps"), ("checkpoint_every", "checkpoint_every")):
        if getattr(args, flag, None) is not None:
            sets.append(f"{key}={getattr(args, flag)}")
    if args.config is not None:
        return load_config(TrainConfig, resolve_config(args.config), sets)
    recorded = Path(args.out) / "train_config.json" if args.command == "fit" else None
    if recorded is not None and recorded.is_file():
        print(f"config: the one {args.out} recorded ({recorded}); --config replaces it")
        return load_config(TrainConfig, recorded, sets)
    resume = ", or resume a run folder that recorded one" if args.command == "fit" else ""
    raise DoelError(
        f"{args.command} needs --config: a preset ({', '.join(presets())}) or a TOML file"
        f"{resume}; its model.vocab_size must equal the tokenizer's size"
    )


def _cmd_fit(args) -> None:
    cfg = train_config(args)  # a bad value fails here, before torch loads
    from doel.train.fit import fit

    fit(
        cfg,
        args.data,
        args.out,
        tokenizer=args.tokenizer,
        fresh=args.fresh,
        skip_verify=args.skip_verify,
        no_checksums=args.no_checksums,
    )


def _cmd_sft(args) -> None:
    from doel.train.config import load_config, resolve_config
    from doel.train.data.conversations import SFTConfig

    sets = list(args.set)
    for flag in ("steps", "checkpoint_every"):
        if getattr(args, flag) is not None:
            sets.append(f"{flag}={getattr(args, flag)}")
    cfg = load_config(SFTConfig, resolve_config(args.config), sets)  # before torch loads
    from doel.train.sft import sft

    sft(
        cfg,
        args.data,
        args.base,
        args.out,
        fresh=args.fresh,
        skip_verify=args.skip_verify,
        no_checksums=args.no_checksums,
    )


def _cmd_check_gradients(args) -> None:
    cfg = train_config(args)
    from doel.train.build import build_parts
    from doel.train.job import gradient_gate

    # The eager model, as before any compilation: the gate alone, quickly.
    gradient_gate(build_parts(cfg, args.data, compile=False), print)


def _cmd_verify(args) -> None:
    cfg = train_config(args)
    from doel.train.checks.base import VerifyConfig
    from doel.train.checks.suite import run_suite
    from doel.train.config import load_config

    vcfg = load_config(VerifyConfig, None, args.check)
    subset = "full" if args.full else "fast"
    report = run_suite(
        cfg,
        args.data,
        subset,
        args.out,
        tokenizer=args.tokenizer,
        vcfg=vcfg,
        checks=args.only,
    )
    if not report.ok:
        sys.exit(1)


def _cmd_eval(args) -> None:
    from doel.train.data.textio import MissingTextField
    from doel.train.evals.heldout import evaluate_checkpoint, format_eval
    from doel.train.evals.hubtasks import fetch_tasks
    from doel.train.evals.tasks import parse_task_specs
    from doel.train.evals.usage import check_repo_id

    if args.repo_id is not None:
        check_repo_id(args.repo_id)  # before any work
    tasks = parse_task_specs(args.tasks)
    local = parse_task_specs(args.local) if args.local else {}
    if unknown := sorted(set(local) - set(tasks)):
        raise DoelError(f"--local {unknown}: not among --tasks {sorted(tasks)}")
    # A hub set that cannot be fetched is named on stderr and left out; the rest is scored.
    tasks, _ = fetch_tasks(
        tasks, Path(args.task_cache), local, log=lambda m: print(m, file=sys.stderr)
    )
    try:
        result = evaluate_checkpoint(
            args.checkpoint,
            args.text,
            max_chars=args.max_chars,
            tasks=tasks,
            limit=args.limit,
            progress=not args.quiet,
            repo_id=args.repo_id,
            card=not args.no_card,
        )
    except MissingTextField as e:
        fix = "eval reads the 'text' field: pass .txt files, or .jsonl/.parquet with a 'text' field"
        raise MissingTextField(e.where, fix) from None
    if args.repo_id is not None and not args.no_card and not result["model_card"]:
        print(
            f"note: {args.checkpoint} has no doel model card (model_card.json), so --repo-id "
            "was not recorded",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else format_eval(result))


def _cmd_plot(args) -> None:
    from doel.train.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")


def _cmd_import(args) -> None:
    from doel.train.adapt.importing import import_model

    import_model(args.source, args.out, force=args.force)


def _cmd_adapt(args) -> None:
    from doel.train.adapt.run import AdaptConfig, adapt, resolve_preset
    from doel.train.config import load_config

    cfg = load_config(AdaptConfig, resolve_preset(args.config), list(args.set))
    adapt(cfg, args.base, args.data, args.out, args.weights, args.chat or (),
          fresh=args.fresh, skip_verify=args.skip_verify)  # fmt: skip


def _data_args(p: argparse.ArgumentParser, config: str, weights_help: str) -> None:
    p.add_argument("--data", nargs="+", required=True, help=".txt/.jsonl/.parquet, folder, hf:NAME")
    p.add_argument("--out", required=True, help="output folder (created; a rerun resumes it)")
    p.add_argument("--weights", nargs="*", default=[], metavar="SOURCE=SHARE", help=weights_help)
    p.add_argument("--config", help=f"TOML file of {config} fields")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"set a {config} field, e.g. min_frequency=2 (repeat it)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars (none unless a terminal)")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="TOML file or preset (tiny, demo, small, bangla-0.4b...); required, except by a fit "
        "that resumes RUN_DIR (its recorded config)",
    )
    p.add_argument("--data", required=True, help="shard folder made by `doel-train prepare`")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. lr=1e-3 or model.hidden_size=256",
    )


def _no_checksums(p: argparse.ArgumentParser, what: str) -> None:
    add_flag(
        p,
        f"use {what} without checking them against their recorded sha256 (a damaged file "
        "is otherwise refused, named)",
    )


MOVED = ("demo", "recipe")  # they use every stage: `doel demo`, `doel recipe` (pipeline/cli.py)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="doel-train", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser(
        "tokenizer",
        help="train a BPE tokenizer -> DIR/tokenizer.json",
        description=(
            "Train a byte-fallback BPE tokenizer that keeps Bengali words whole, at exactly "
            "--vocab-size tokens (unused reserved tokens fill what the corpus cannot), with "
            "the chat markers and the chat template. Writes tokenizer.json and the Hugging "
            "Face side files into --out."
        ),
    )
    t.add_argument(
        "--vocab-size", type=int, default=None, help=f"default {TOKENIZER_DEFAULTS['vocab_size']}"
    )
    t.add_argument(
        "--style",
        choices=STYLES,
        help=f"{TOKENIZER_DEFAULTS['style']} (default): SentencePiece BPE; gguf: byte-level BPE "
        "(llama.cpp runs either id for id, so doel-export --format gguf takes either); doel: "
        "doel's own split, which a GGUF cannot carry; doel-bytelevel, marks-bytelevel, gpt2: "
        "ablations",
    )
    _data_args(t, "TokenizerConfig", "each source's share of the training characters")
    t.set_defaults(func=_cmd_tokenizer)

    f = sub.add_parser(
        "fertility",
        help="characters/bytes/words per token, per script",
        description=(
            "Measure any tokenizer on text: characters, bytes and words per token, tokens per "
            "word and byte-fallback share, per script (Bengali, Latin, ...). Prints a table, "
            "or JSON with --json."
        ),
    )
    f.add_argument(
        "--tokenizer",
        type=tokenizer_path,
        required=True,
        help="tokenizer.json, tekken .json, .tiktoken, SentencePiece model, vocab.txt",
    )
    f.add_argument(
        "--text",
        nargs="+",
        required=True,
        help="text to measure: .txt/.jsonl/.parquet files or folders (held-out text is fairest)",
    )
    f.add_argument("--pattern", help="split regex for a .tiktoken file (default by its name)")
    f.add_argument("--text-field", default="text", help="JSONL field / Parquet column")
    f.add_argument("--json", action="store_true", help="print the report as JSON")
    f.set_defaults(func=_cmd_fertility)

    r = sub.add_parser(
        "prepare",
        help="corpus -> packed token shards + meta.json",
        description=(
            "Tokenize a corpus into packed token shards with a validation split, the sources "
            "mixed by shares of characters, documents deduplicated and the validation text "
            "checked for overlap with training. A rerun on the same --out resumes at the last "
            "finished shard, to the same bytes."
        ),
    )
    r.add_argument(
        "--tokenizer", type=tokenizer_path, required=True, help="the tokenizer.json to encode with"
    )
    _data_args(r, "PrepareConfig", "each source's share of characters (others downsampled)")
    g = r.add_mutually_exclusive_group()
    g.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share of the documents held out for validation (instead of --val)",
    )
    g.add_argument("--val", nargs="+", help="validation files (checked for overlap with train)")
    r.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    r.set_defaults(func=_cmd_prepare)

    fi = sub.add_parser(
        "fit",
        help="train a model on token shards (resumes RUN_DIR)",
        description=(
            "Train a Llama model on token shards: the verification checks and the gradient- "
            "flow gate before step 1, then the step loop with logs, validation and "
            "checkpoints in --out. A rerun on the same --out resumes from the last "
            "checkpoint, bit for bit; under torchrun it trains on every GPU (DDP or FSDP)."
        ),
    )
    _train_args(fi)
    fi.add_argument("--out", required=True, help="run folder (checkpoints/, final/, metrics)")
    fi.add_argument("--steps", type=int, help="optimizer steps in all (default: the config's)")
    fi.add_argument(
        "--checkpoint-every", type=int, help="steps between checkpoints (default: the config's)"
    )
    fi.add_argument(
        "--tokenizer", type=tokenizer_path, help="default: the one named in the shards' meta.json"
    )
    fi.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    fi.add_argument(
        "--skip-verify",
        action="store_true",
        help="skip the verification suite before step 1 (loudly; the gradient gate still runs)",
    )
    _no_checksums(fi, "the shards and the checkpoint resumed from")
    fi.set_defaults(func=_cmd_fit)

    sf = sub.add_parser(
        "sft",
        help="chat fine-tuning of a base checkpoint (resumes RUN_DIR)",
        description=(
            "Fine-tune a base model for chat on conversations: the loss on the assistant's "
            "replies only, the chat checks (the loss mask among them) before step 1, "
            "checkpoints and exact resume as fit's. The model's shape comes from --from."
        ),
    )
    sf.add_argument(
        "--config",
        required=True,
        help="TOML file or preset of training and chat-data settings (its [model] is the base's)",
    )
    sf.add_argument(
        "--data",
        nargs="+",
        required=True,
        help='conversations: .jsonl/.parquet ({"messages": [...]} a row), folders, hf:NAME',
    )
    sf.add_argument("--from", dest="base", required=True, help="the base model folder (RUN/final)")
    sf.add_argument("--out", required=True, help="run folder (checkpoints/, final/, metrics)")
    sf.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override, e.g. lr=1e-4 or overlong=drop (repeat it)",
    )
    sf.add_argument("--steps", type=int, help="optimizer steps in all (default: the config's)")
    sf.add_argument(
        "--checkpoint-every", type=int, help="steps between checkpoints (default: the config's)"
    )
    sf.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    sf.add_argument(
        "--skip-verify",
        action="store_true",
        help="skip the checks before step 1 (loudly; the gradient gate still runs)",
    )
    _no_checksums(sf, "the base model and the checkpoint resumed from")
    sf.set_defaults(func=_cmd_sft)

    cg = sub.add_parser(
        "check-gradients",
        help="run the gradient-flow gate alone",
        description=(
            "One forward and backward pass on the model a run would train: every trainable "
            "parameter must get a finite, nonzero gradient and tied weights must stay one "
            "tensor. Names each offender; exits 1 on a failure."
        ),
    )
    _train_args(cg)
    cg.set_defaults(func=_cmd_check_gradients)

    v = sub.add_parser(
        "verify",
        help="the silent-failure checks -> REPORT_DIR/verify.{md,json}",
        description=(
            "Run the verification suite on the exact model, kernels, dtype and compile "
            "setting of a run (gradient flow, fast paths against float64, ties, causal leak, "
            "label shift, accumulation, resume, throughput, data and tokenizer). Writes "
            "verify.md and verify.json into --out; exits 1 on a failure."
        ),
    )
    _train_args(v)
    v.add_argument("--out", required=True, help="report folder")
    v.add_argument("--full", action="store_true", help="all checks (default: fit's fast subset)")
    v.add_argument("--only", nargs="+", metavar="CHECK", help="just these checks")
    v.add_argument(
        "--tokenizer", type=tokenizer_path, help="default: the one named in the shards' meta.json"
    )
    v.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a threshold, e.g. mfu_floor=0.3 or max_backward_ratio=3",
    )
    v.set_defaults(func=_cmd_verify)

    e = sub.add_parser(
        "eval",
        help="bits/char per language, zero-shot tasks",
        description=(
            "Evaluate a model folder: held-out bits per character per language against its "
            "random twin and xz/bzip2, sample texts, and zero-shot accuracy on task files or "
            "hub sets. A folder with doel's model card gets the card rewritten with the "
            "results."
        ),
    )
    e.add_argument("checkpoint", help="a model folder in Hugging Face layout")
    e.add_argument("--text", nargs="+", required=True, help="held-out text files")
    e.add_argument("--max-chars", type=int, default=None, help="cap per language")
    e.add_argument(
        "--tasks",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="zero-shot tasks, e.g. hellaswag=val.jsonl piqa=DIR arc_easy=arc_easy.jsonl "
        "bangla_mmlu=hf:hishab/bangla-mmlu (a hub set, hf:OWNER/NAME[:CONFIG][@SPLIT])",
    )
    e.add_argument(
        "--task-cache",
        default=str(Path.home() / ".cache" / "doel" / "tasks"),
        help="where hf: task sets are fetched to, once (default ~/.cache/doel/tasks)",
    )
    e.add_argument(
        "--local",
        nargs="+",
        default=[],
        metavar="NAME=FILE",
        help="a .jsonl/.parquet file of a hub set's rows standing in for it (no hub needed)",
    )
    e.add_argument("--limit", type=int, default=None, help="first N items of each task")
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    e.add_argument(
        "--no-card",
        action="store_true",
        help="leave the checkpoint's model card as it is (default: add these figures to it)",
    )
    e.add_argument("--quiet", action="store_true", help="no progress bars (none unless a terminal)")
    e.add_argument(
        "--repo-id",
        help="the model's Hugging Face repository (OWNER/NAME): its card's usage loads it from "
        "there, and export bundles name it as their base model",
    )
    e.set_defaults(func=_cmd_eval)

    pl = sub.add_parser(
        "plot",
        help="loss and throughput curves of a run -> PNG",
        description=(
            "Draw a run's loss (train and validation) and throughput curves from its "
            "metrics.jsonl into a PNG."
        ),
    )
    pl.add_argument("run_dir", help="a run folder of fit or sft (it holds metrics.jsonl)")
    pl.add_argument("--out", help="default RUN_DIR/curves.png")
    pl.set_defaults(func=_cmd_plot)

    im = sub.add_parser(
        "import",
        help="an existing Llama (Hugging Face folder or GGUF) -> a doel model folder",
        description=(
            "Import an existing Llama-architecture model, a Hugging Face folder (safetensors) "
            "or a llama.cpp GGUF (dequantized to float32), as a model folder that doel-export, "
            "doel-serve, eval and sft take as they take RUN/final. The model keeps its own "
            "tokenizer (a GGUF's rebuilt as llama.cpp tokenizes), chat template, special and "
            "stop tokens and context length. A model that is not Llama-shaped is refused, "
            "naming what differs."
        ),
    )
    im.add_argument("source", help="a .gguf file, or a Hugging Face model folder")
    im.add_argument("--out", required=True, help="the model folder to write (appears whole)")
    im.add_argument("--force", action="store_true", help="replace --out if it exists")
    im.set_defaults(func=_cmd_import)

    ad = sub.add_parser(
        "adapt",
        help="an imported model + Bangla and English text -> a Bangla-fair chat model",
        description=(
            "Adapt an imported model (doel-train import) to Bangla: its tokenizer extended "
            "with Bangla tokens (or replaced), new rows initialised from the base's, continued "
            "pretraining on the text with fit's checks and exact resume, then chat fine-tuning "
            "in the base's own template. A rerun continues where it stopped (docs/adapt.md)."
        ),
    )
    ad.add_argument("base", help="the imported model folder (doel-train import --out)")
    ad.add_argument("--data", nargs="+", required=True, help="Bangla and English text files")
    ad.add_argument("--out", required=True, help="run folder (adapted/, shards/, ..., final)")
    ad.add_argument("--weights", nargs="*", default=[], metavar="SOURCE=SHARE",
                    help="shares of characters by source, e.g. bn=2 en=1")  # fmt: skip
    ad.add_argument("--chat", nargs="+", help="conversations (.jsonl) for the chat stage")
    ad.add_argument("--config", help="TOML file or preset (recipes/adapt-*/adapt.toml)")
    ad.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override, e.g. pretrain.steps=10 or split=base (repeat it)")  # fmt: skip
    ad.add_argument("--fresh", action="store_true", help="start over instead of resuming")
    ad.add_argument(
        "--skip-verify",
        action="store_true",
        help="skip the checks before step 1 (loudly; the gradient gates still run)",
    )
    ad.set_defaults(func=_cmd_adapt)

    for name in MOVED:
        sub.add_parser(name, help=f"moved: `doel {name}`", add_help=False)
    return p


def run_command(args, missing: str) -> None:
    """Run a parsed command, turning what a user can fix into one line and an exit code:
    a missing package (`missing` names the extra, formatted with the package's name), a
    DoelError, Ctrl-C (130, as a shell reports SIGINT). `doel` (pipeline/cli.py) runs its
    commands through this too."""
    try:
        args.func(args)
    except ModuleNotFoundError as e:
        sys.exit(missing.format(name=e.name))
    except Interrupted as e:  # Ctrl-C where the command says what was kept (fit)
        print(e, file=sys.stderr)
        sys.exit(130)
    except DoelError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in MOVED:  # before parsing: their options are not doel-train's
        sys.exit(f"error: `doel-train {argv[0]}` is now `doel {argv[0]}` (same options)")
    args = build_parser().parse_args(argv)
    run_command(
        args, f"doel-train needs the {{name!r}} package, part of the train extra: {EXTRA_HINT}"
    )

"""`make demo`: the whole training path on the built-in sample, in a few minutes on 2 CPU cores.

tokenizer → fertility → held-out split → shards → gradient-flow gate → training → evaluation
against the random twin and xz/bzip2 → samples. The sample is only ~50 KB, so the model is tiny
and the numbers show the path working, not a useful model (`configs/small.toml` on real text is
that).
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_DIR = Path(__file__).parent / "sample"
HOLDOUT_EVERY = 8  # every 8th paragraph of each sample file is held out for evaluation


def split_sample(out: Path) -> tuple[list[str], list[str]]:
    """Write train/ and heldout/ copies of the sample files, split by paragraph."""
    from train.textio import iter_documents

    train, held = [], []
    for name in ("bn.txt", "en.txt"):
        docs = list(iter_documents(str(SAMPLE_DIR / name)))
        parts = {"train": [], "heldout": []}
        for i, doc in enumerate(docs):
            parts["heldout" if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else "train"].append(doc)
        for split, lst in (("train", train), ("heldout", held)):
            path = out / f"{split}-{name}"  # distinct names: prepare tells sources by name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n\n".join(parts[split]) + "\n", encoding="utf-8")
            lst.append(str(path))
    return train, held


def run_demo(out: str | Path, vocab_size: int = 4096, config: str = "demo", sets=()) -> Path:
    from train.cli import resolve_config
    from train.config import load_config
    from train.evaluate import evaluate_checkpoint, format_eval
    from train.fertility import fertility, format_report, load_any
    from train.fit import fit
    from train.prepare import PrepareConfig, prepare
    from train.textio import iter_source, resolve_sources
    from train.tokenizer import TokenizerConfig, train_tokenizer
    from train.trainer import TrainConfig

    out = Path(out)
    train_files, heldout = split_sample(out / "text")
    print(f"1/6 tokenizer: {vocab_size} tokens trained on the built-in sample ({train_files})")
    tok = train_tokenizer(
        resolve_sources(train_files),
        TokenizerConfig(vocab_size=vocab_size),
        out / "tokenizer",
        progress=False,
    )
    print(f"    wrote {tok}\n2/6 fertility on the held-out paragraphs")
    texts = [d for s in resolve_sources(heldout) for d in iter_source(s)]
    print(format_report(str(tok), fertility(load_any(tok), texts)))
    print(f"3/6 token shards (every {HOLDOUT_EVERY}th paragraph held out as validation)")
    prepare(tok, train_files, out / "shards", PrepareConfig(), val=heldout, progress=False)
    cfg = load_config(
        TrainConfig, resolve_config(config), [f"model.vocab_size={vocab_size}", *sets]
    )
    print(
        "4/6 gradient-flow gate, then training (resumes if run before; delete the folder to "
        "start over)"
    )
    final = fit(cfg, out / "shards", out / "run")
    print("5/6 evaluation on the held-out paragraphs against the random twin and compressors")
    result = evaluate_checkpoint(
        final, {"bn": heldout[:1], "en": heldout[1:]}, seq_len=cfg.seq_len, max_new_tokens=30
    )
    print(format_eval(result))
    from train.metrics import plot_run

    print(f"6/6 curves: {plot_run(out / 'run')}")
    print(f"done: the model in Hugging Face layout is {final}")
    export_demo(final, out / "bundle-int4", heldout)
    return final


def export_demo(final: Path, bundle: Path, heldout: list[str]) -> Path | None:
    """After training: the int4 bundle that serving runs, with its size and parity figures (the
    loss increase measured on the held-out paragraphs)."""
    print(f"export: int4 bundle for serving and phones -> {bundle}")
    try:
        from export.bundle import ExportOptions, export_checkpoint, summary

        opts = ExportOptions(
            quant="int4",
            mobile=True,
            force=True,
            texts=tuple(heldout),
            log=lambda m: print(f"    {m}"),
        )
        manifest = export_checkpoint(final, bundle, opts)
    except ModuleNotFoundError as e:  # a machine with the train extra only
        print(f"    skipped: it needs {e.name!r}: pip install 'doel[export]'")
        return None
    print(summary(bundle, manifest))
    return bundle

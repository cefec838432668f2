"""prepare resumes: a run stopped at every third batch, before or after that batch reached the
shards, then run again, leaves the bytes of an uninterrupted run (shards and meta.json apart
from its timing) without re-reading what was recorded; other inputs or settings, or a damaged
folder, start over and say why; `--fresh` ignores the record; a failed overlap check reruns
from the end; a copy of validation text met after a resume still fails the run."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import doel.train.data.prepare as prep
from doel.train.cli import main
from doel.train.common import DoelError
from doel.train.data.prepare import PrepareConfig, prepare
from doel.train.data.stream import Reader

# Small batches and shards: a few dozen batches, several shards, records in between.
CFG = PrepareConfig(val_fraction=0.1, shard_tokens=1500, batch_chars=1500)


class Interrupted(Exception):
    pass


@pytest.fixture
def counting(monkeypatch):
    """Counts of batches written and documents read (asked to `keep`), and a way to stop the
    run at the k-th batch, just before or just after it is written (no record after it)."""
    n = {"batches": 0, "docs": 0, "stop": None, "when": None}
    write, keep = prep._Run.write, Reader.keep

    def counted_write(self, batch, encs):
        if n["stop"] == n["batches"] and n["when"] == "before":
            raise Interrupted
        closed = write(self, batch, encs)
        if n["stop"] == n["batches"] and n["when"] == "after":
            raise Interrupted
        n["batches"] += 1
        return closed

    def counted_keep(self, name, text):
        n["docs"] += 1
        return keep(self, name, text)

    monkeypatch.setattr(prep._Run, "write", counted_write)
    monkeypatch.setattr(Reader, "keep", counted_keep)
    return n


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_paths) -> list[str]:
    """The sample corpus with exact duplicates of early documents late in each file, so that
    dropping them depends on what was recorded before an interruption."""
    folder = tmp_path_factory.mktemp("corpus")
    paths = []
    for p in sample_paths:
        lines = Path(p).read_text(encoding="utf-8").splitlines()
        (folder / Path(p).name).write_text("\n".join(lines + lines[:12:2]) + "\n", "utf-8")
        paths.append(str(folder / Path(p).name))
    return paths


def run(tok, data, out, logs=None, cfg=CFG, **kw) -> dict:
    log = logs.append if logs is not None else (lambda *a: None)
    return prepare(tok, data, out, cfg, progress=False, log=log, **kw)


def output(out: Path) -> dict:
    """Every file in the folder (bytes), meta.json without its timing."""
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    meta = json.loads(files.pop("meta.json"))
    del meta["seconds"], meta["tokens_per_second"]
    return {"files": files, "meta": meta, "dirs": [p.name for p in out.iterdir() if p.is_dir()]}


def interrupted(tok, data, out, counting, k: int, when: str, **kw) -> None:
    counting.update(stop=k, when=when, batches=0)
    with pytest.raises(Interrupted):
        run(tok, data, out, **kw)
    counting.update(stop=None, batches=0, docs=0)


@pytest.mark.parametrize("kind", ["weights", "val-files"])
def test_a_run_stopped_at_any_batch_resumes_to_the_same_bytes(
    tmp_path, tokenizer_path, corpus, counting, kind
):
    kw = {"weights": ["bn=3", "en=1"]}
    cfg = CFG
    if kind == "val-files":  # read first; near-copies of training text, so overlap is found
        lines = Path(corpus[0]).read_text(encoding="utf-8").splitlines()
        val = tmp_path / "val.txt"
        val.write_text("".join(f"{x[:150]} নতুন কথা {i}\n" for i, x in enumerate(lines[::4])))
        kw, cfg = {"val": [str(val)]}, replace(CFG, val_fraction=0.0, max_val_overlap=1.0)
    whole = run(tokenizer_path, corpus, tmp_path / "whole", cfg=cfg, **kw)
    batches, docs = counting["batches"], counting["docs"]
    assert batches > 10 and len(whole["splits"]["train"]["shards"]) > 3
    assert whole["sources"]["bn"]["duplicates_dropped"] == 6
    if kind == "val-files":
        assert whole["overlap"]["in_train"] > 0 and whole["splits"]["val"]["documents"] > 5
    expected = output(tmp_path / "whole")
    for k in range(0, batches, 3):
        for when in ("before", "after"):
            out = tmp_path / f"{when}{k}"
            interrupted(tokenizer_path, corpus, out, counting, k, when, cfg=cfg, **kw)
            logs: list[str] = []
            run(tokenizer_path, corpus, out, logs, cfg=cfg, **kw)
            assert output(out) == expected, (k, when)
            resumed = any(x.startswith("prepare: resuming after") for x in logs)
            # A record is saved after each batch that finished a shard; with one, the
            # documents it covers are not read (normalized, hashed) again.
            assert resumed == (counting["docs"] < docs), (k, when)
            if k >= batches // 2:
                assert resumed


def test_a_resumed_run_stopped_again_still_ends_the_same(
    tmp_path, tokenizer_path, corpus, counting
):
    run(tokenizer_path, corpus, tmp_path / "whole")
    out = tmp_path / "out"
    interrupted(tokenizer_path, corpus, out, counting, 5, "after")
    interrupted(tokenizer_path, corpus, out, counting, 4, "before")
    run(tokenizer_path, corpus, out)
    assert output(out) == output(tmp_path / "whole")


def test_other_inputs_or_settings_start_over_and_say_why(
    tmp_path, tokenizer_path, corpus, counting
):
    data = [str(shutil.copy(p, tmp_path)) for p in corpus]
    tok = Path(shutil.copy(tokenizer_path, tmp_path))

    def appended(path, text: str) -> dict:
        with open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return {}

    cases = {
        "the settings": lambda: {"cfg": replace(CFG, shard_tokens=1000)},
        "the weights": lambda: {"weights": ["bn=1", "en=1"]},
        "the data files": lambda: appended(data[1], "A new line at the end.\n"),
        "the tokenizer": lambda: appended(tok, "\n"),  # loads the same, hashes otherwise
    }
    for what, change in cases.items():
        out = tmp_path / what.replace(" ", "-")
        interrupted(tok, data, out, counting, 8, "after")
        kw, logs = change(), []
        run(tok, data, out, logs, **kw)
        assert f"{what} changed since it was written; starting over" in "\n".join(logs), logs
        run(tok, data, tmp_path / "whole", **kw)
        assert output(out) == output(tmp_path / "whole"), what


def test_fresh_ignores_the_record(tmp_path, tokenizer_path, corpus, counting, capsys):
    out = tmp_path / "out"
    interrupted(tokenizer_path, corpus, out, counting, 8, "after")
    (out / "train_000099.bin").write_bytes(b"an older run's shard")
    args = ["prepare", "--tokenizer", str(tokenizer_path), "--data", *corpus]
    args += ["--out", str(out), "--quiet", "--set", f"shard_tokens={CFG.shard_tokens}"]
    args += ["--set", f"batch_chars={CFG.batch_chars}", "--val-fraction", "0.1"]
    main([*args, "--fresh"])
    assert "resuming" not in capsys.readouterr().out
    fresh_docs = counting["docs"]
    assert not (out / "train_000099.bin").exists()  # a fresh start leaves no older shard
    assert not (out / "prepare_state").exists()  # a finished run leaves no record
    run(tokenizer_path, corpus, tmp_path / "whole")
    assert output(out) == output(tmp_path / "whole")
    counting["docs"] = 0
    interrupted(tokenizer_path, corpus, out, counting, 8, "after")
    main(args)
    assert "prepare: resuming after" in capsys.readouterr().out
    assert counting["docs"] < fresh_docs
    assert output(out) == output(tmp_path / "whole")


def test_a_failed_overlap_check_reruns_from_the_end(tmp_path, tokenizer_path, corpus, counting):
    val = tmp_path / "val.txt"
    lines = Path(corpus[0]).read_text(encoding="utf-8").splitlines()
    val.write_text(f"{lines[3][:200]} নতুন কথা\nসম্পূর্ণ নতুন একটি বাক্য।\n", encoding="utf-8")
    cfg = replace(CFG, val_fraction=0.0)
    with pytest.raises(DoelError, match="validation text also sits in the training set"):
        run(tokenizer_path, corpus, tmp_path / "out", cfg=cfg, val=[str(val)])
    counting["docs"] = 0
    logs: list[str] = []
    tolerant = replace(cfg, max_val_overlap=1.0)
    meta = run(tokenizer_path, corpus, tmp_path / "out", logs, cfg=tolerant, val=[str(val)])
    assert any(x.startswith("prepare: resuming after") for x in logs)
    assert counting["docs"] == 0  # nothing read again: only the check ran
    assert meta["overlap"]["in_train"] > 0 and meta["config"]["max_val_overlap"] == 1.0


def test_validation_copies_met_after_a_resume_still_fail_the_run(
    tmp_path, tokenizer_path, corpus, counting
):
    # lines[10] is a training document, and its copy comes again at the end of the file.
    val = tmp_path / "val.txt"
    lines = Path(corpus[0]).read_text(encoding="utf-8").splitlines()
    val.write_text(f"{lines[10]}\nসম্পূর্ণ নতুন একটি বাক্য।\n", encoding="utf-8")
    kw = {"cfg": replace(CFG, val_fraction=0.0), "val": [str(val)]}
    with pytest.raises(DoelError, match="2 validation documents appear there whole") as whole:
        run(tokenizer_path, corpus, tmp_path / "whole", **kw)
    interrupted(tokenizer_path, corpus, tmp_path / "out", counting, 4, "after", **kw)
    with pytest.raises(DoelError) as resumed:
        run(tokenizer_path, corpus, tmp_path / "out", **kw)
    assert len(lines) < counting["docs"] < 2 * len(lines)  # resumed in bn.txt, before its end
    assert str(resumed.value) == str(whole.value)


def test_a_damaged_folder_starts_over(tmp_path, tokenizer_path, corpus, counting):
    run(tokenizer_path, corpus, tmp_path / "whole")
    out = tmp_path / "out"
    for damage, message in (
        (lambda: (out / "train_000000.bin").write_bytes(b"other"), "finished shard"),
        (lambda: next(out.glob("*.tmp")).write_bytes(b""), "unfinished shard"),
        (lambda: (out / "prepare_state" / "seen.bin").write_bytes(b""), "seen.bin is missing"),
    ):
        interrupted(tokenizer_path, corpus, out, counting, 8, "before")
        damage()
        logs: list[str] = []
        run(tokenizer_path, corpus, out, logs)
        assert any(message in x and x.endswith("starting over") for x in logs), logs
        assert output(out) == output(tmp_path / "whole")

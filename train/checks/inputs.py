"""The verification suite's data checks: validation text that also sits in training (the
overlap figures prepare wrote to meta.json), repeated windows in what the loader serves, each
source's share of tokens beside its share of characters, and the tokenizer's characters per
token per script with the warning when one language gets under half of another's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from doel.train.checks.base import CheckResult, Setup
from doel.train.common import DoelError
from doel.train.data.fertility import balance_warnings, fertility, load_any
from doel.train.data.loader import check_tokenizer, read_meta
from doel.train.data.shards import open_shard

# ------------------------------------------------------------------ 9. data


def repeated_windows(s: Setup) -> dict:
    """Hash the windows a fresh loader serves over (at most) one epoch: each should be new."""
    loader = s.make_loader()
    epoch = getattr(loader, "n_windows", s.vcfg.data_windows)
    per_batch = getattr(loader, "global_batch", s.cfg.batch_size)  # all ranks' rows a step
    n_batches = max(1, min(s.vcfg.data_windows, epoch) // per_batch)
    seen: dict[bytes, int] = {}
    for _ in range(n_batches):
        x, y = loader.next_batch()
        for xr, yr in zip(np.asarray(x), np.asarray(y)):
            key = hashlib.blake2b(xr.tobytes() + yr[-1:].tobytes(), digest_size=8).digest()
            seen[key] = seen.get(key, 0) + 1
    total = sum(seen.values())
    return {
        "windows": total,
        "repeated": total - len(seen),
        "repeated_share": (total - len(seen)) / max(total, 1),
    }


def check_data(s: Setup) -> CheckResult:
    meta, v = read_meta(s.data_dir), s.vcfg
    bad = []
    ov = meta.get("overlap")
    allowed = (
        v.max_val_overlap
        if v.max_val_overlap >= 0
        else meta.get("config", {}).get("max_val_overlap", 0.0)
    )
    numbers: dict = {"max_val_overlap": allowed}
    if ov:
        dups = ov.get("exact_duplicates_of_validation_in_train", 0)
        numbers |= {"val_ngram_share_in_train": ov["share"], "val_docs_in_train_whole": dups}
        if dups or ov["share"] > allowed:
            bad.append(
                f"validation text sits in training: {ov['share']:.2%} of validation "
                f"{ov['ngram_tokens']}-token n-grams, {dups} whole documents"
            )
    else:
        numbers["val_ngram_share_in_train"] = None  # no validation split: nothing to compare
    rep = repeated_windows(s)
    numbers |= rep
    if rep["repeated_share"] > v.max_repeated_windows:
        bad.append(
            f"{rep['repeated']} of {rep['windows']} windows served within one epoch "
            f"repeat an earlier one ({rep['repeated_share']:.1%})"
        )
    shares = {}
    # Shares are asked of the training mix: explicit validation files (sources of their own,
    # with no training characters) must not dilute them.
    sources = meta.get("sources", {})
    train_chars = sum(s["train_characters"] for s in sources.values()) or 1
    for name, src in sources.items():
        asked = src.get("requested_char_share")
        shares[name] = {k: src.get(k) for k in ("char_share", "token_share", "chars_per_token")}
        shares[name]["requested_char_share"] = asked
        got = src["train_characters"] / train_chars
        if asked is not None and abs(got - asked) > v.share_tolerance:
            bad.append(f"{name}: {got:.1%} of training characters, {asked:.1%} asked")
    numbers["sources"] = shares
    return CheckResult(
        "data",
        "validation n-grams found in training (meta.json), windows repeated within one epoch "
        "of the loader, each source's share of characters (vs asked) beside its share of tokens",
        not bad,
        numbers,
        "; ".join(bad) or "no overlap, no repeats, shares as asked",
    )


# ------------------------------------------------------------------ 10. tokenizer


def sample_documents(data_dir, meta: dict, n: int, max_tokens: int = 2048) -> list[np.ndarray]:
    """n documents spread evenly over the training shards (every document starts with bos)."""
    bos = meta["tokenizer"]["bos_id"]
    shards = [
        open_shard(Path(data_dir) / sh["file"])[1] for sh in meta["splits"]["train"]["shards"]
    ]
    docs, seen = [], set()
    for shard_i, tokens in enumerate(shards):
        share = max(1, round(n * len(tokens) / max(1, sum(len(t) for t in shards))))
        for start in np.linspace(0, max(0, len(tokens) - 1), share).astype(np.int64):
            chunk = np.asarray(tokens[start : start + 4 * max_tokens])
            at = np.flatnonzero(chunk == bos)
            if not len(at) or (shard_i, int(start + at[0])) in seen:
                continue
            seen.add((shard_i, int(start + at[0])))
            end = at[1] if len(at) > 1 else len(chunk)
            docs.append(chunk[at[0] + 1 : min(end, at[0] + 1 + max_tokens)])
    return [d for d in docs if len(d)]


def _tokenizer_path(s: Setup, meta: dict) -> Path | None:
    path = Path(s.tokenizer) if s.tokenizer else Path(meta["tokenizer"]["path"])
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


def check_tokenizer_fairness(s: Setup) -> CheckResult:

    meta = read_meta(s.data_dir)
    checked = (
        "characters/token per script on documents decoded from the training shards; "
        "fails when one language gets under half of another's"
    )
    path = _tokenizer_path(s, meta)
    if path is None:
        return CheckResult(
            "tokenizer",
            checked,
            None,
            {},
            f"tokenizer {meta['tokenizer']['path']} not found; pass --tokenizer",
        )
    try:
        check_tokenizer(meta, path, s.data_dir)
    except DoelError as e:
        return CheckResult("tokenizer", checked, False, {}, str(e))
    docs = sample_documents(s.data_dir, meta, s.vcfg.tokenizer_docs)
    texts = Tokenizer.from_file(str(path)).decode_batch([d.tolist() for d in docs])
    report = fertility(load_any(path), texts)
    warnings = balance_warnings(report)
    numbers = {
        script: {
            "characters": r["characters"],
            "chars_per_token": r["chars_per_token"],
            "byte_fallback_rate": r["byte_fallback_rate"],
        }
        for script, r in report.items()
    }
    numbers["documents"] = len(texts)
    return CheckResult(
        "tokenizer",
        checked,
        not warnings,
        numbers,
        " ".join(warnings) or "no language under half of another's chars/token",
    )

"""Checkpoint -> ExecuTorch: DIR/model-<quant>.pte (XNNPACK; int4 = `8da4w`, int8 = `8da8w`,
export/pte_build.py, run in ExecuTorch's own venv) with tokenizer.json, tokenizer_config.json (the
chat template) and manifest.json, what ExecuTorch's LLM runner and the apps on it
(executorch-android's LlmModule, the iOS runner, react-native-executorch's useLLM) are given.

The runner tokenizes with pytorch-tokenizers' C++ HFTokenizer, its own reading of tokenizer.json,
which is not `tokenizers` (benchmarks/runtimes/executorch.py holds it to `tokenizers`' ids):
- SentencePiece BPE (doel's default spm style) and a byte-level BPE with one Split before the
  ByteLevel step (doel's gguf style, GPT-2's form) give `tokenizers`' ids as they are. The spm
  form's decoder loses its last step, Strip (one leading space off the whole text): the runner
  decodes one token at a time, and a Strip there took every word's space off ("নদীনদী" for
  "নদী নদী"); without it the stream is doel-serve's, the first word's space included.
- A byte-level BPE that splits digits first and then GPT-2's regex (SmolLM2's, StarCoder's: two
  Split steps) comes out empty or cut short: pytorch-tokenizers keeps only what the first Split
  isolated. The bundle's tokenizer.json gets the one regex that splits the same pieces (DIGIT_GPT2:
  each digit alone, a run of spaces before a digit whole, GPT-2's rules elsewhere); the ids are
  `tokenizers`' on every validation line and corner case (the runtimes table).
- Anything else (the doel style: characters with byte fallback and a split of its own) is written
  as it is and recorded as not exact (`runtime_tokenizer`), with one line saying so.

BOS: the runner adds `num_bos` BOS tokens itself (GenerationConfig); the manifest says how many
this tokenizer's post-processor puts in front (`add_bos`). Stops: the program's get_eos_ids holds
EOS and the end of turn, so a chat reply ends where doel-serve's does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from doel.contracts.manifest import Manifest
from doel.export import phone
from doel.export.checkpoint import source_record
from doel.export.common import file_table, staging, write_json
from doel.export.tokenform import DIGIT, GPT2_SPLIT, is_sentencepiece, splits, why_not_byte_level

BUILDER = Path(__file__).with_name("pte_build.py")
# (DIGIT, GPT2_SPLIT) as one regex: a space run before a digit stays whole, as it does when the
# digits are cut out first (tests/export/test_pte.py; benchmarks/runtimes/executorch.py)
DIGIT_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"
NOT_EXACT = (
    "ExecuTorch's tokenizer (pytorch-tokenizers) does not give this tokenizer's ids ({why}); an "
    "app on ExecuTorch must bring ids from `tokenizers`, or (a model of doel's own) train it on "
    "`doel-train tokenizer --style spm` (the default)"
)

# The runner and a byte-level tokenizer's text (benchmarks/runtimes/executorch_smollm2.py)
BYTE_STREAM = (
    "ExecuTorch's runner streams each token's text alone: a character that byte-level tokens "
    "split (every Bengali one) reaches the app as U+FFFD; keep the pieces' bytes and show them "
    "once whole (docs/phones.md), or use the default spm tokenizer"
)


def runtime_tokenizer(tok: dict) -> tuple[dict, dict]:
    """(the tokenizer.json ExecuTorch's runner is given, the manifest's record of it)."""
    if is_sentencepiece(tok):
        steps = [d for d in tok["decoder"]["decoders"] if d.get("type") != "Strip"]
        decoder = {**tok["decoder"], "decoders": steps}
        return {**tok, "decoder": decoder}, {
            "exact": True,
            "form": "spm",
            "rewritten": "the decoder's Strip step dropped (the runner decodes token by token)",
        }
    why = why_not_byte_level(tok)
    if why is None:
        found = splits(tok)
        if len(found) == 1:
            return tok, {"exact": True, "form": "byte-level", "stream": BYTE_STREAM}
        if found == (DIGIT, GPT2_SPLIT):
            return _one_split(tok, DIGIT_GPT2), {
                "exact": True,
                "form": "byte-level",
                "rewritten": "the digit split and GPT-2's as one regex",
                "stream": BYTE_STREAM,
            }
        why = "several Split steps, of which pytorch-tokenizers keeps the first's pieces only"
    return tok, {"exact": False, "form": "other", "why": NOT_EXACT.format(why=why)}


def _one_split(tok: dict, regex: str) -> dict:
    byte_level = dict(tok["pre_tokenizer"]["pretokenizers"][-1], use_regex=False)
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    pre = {"type": "Sequence", "pretokenizers": [split, byte_level]}
    return {**tok, "pre_tokenizer": pre}


def export_pte(
    checkpoint: str | Path,
    out: str | Path,
    quant: str = phone.DEFAULT_QUANT,
    force: bool = False,
    tokenizer: str | Path | None = None,
    max_seq_len: int | None = None,
    log=print,
    verify: bool = True,
) -> dict:
    """Write OUT/model-<quant>.pte, its tokenizer files and manifest.json, all or nothing
    (module docstring)."""
    ckpt, python, seq, tok = phone.opening(
        checkpoint, "pte", "executorch", quant, tokenizer, max_seq_len, verify
    )
    runtime_tok, record = runtime_tokenizer(tok)
    if not record["exact"]:
        log(f"note: {record['why']}")
    if "stream" in record:
        log(f"note: {record['stream']}")
    out, name = Path(out), f"model-{quant}.pte"
    with staging(out, force) as stage:
        spec = {
            "config": ckpt.config,
            "weights": [str(p.resolve()) for p in ckpt.weights],
            "quant": quant,
            "max_seq_len": seq,
            "bos_id": phone.bos_id(ckpt),
            "eos_ids": phone.stop_ids(ckpt),
            "out": str(stage / name),
        }
        log(f"building {name} in {python.parent.parent} ({quant}, {seq} positions)")
        built = phone.run_script(python, BUILDER, spec, stage)
        if runtime_tok is tok:
            shutil.copyfile(ckpt.tokenizer, stage / "tokenizer.json")
        else:
            write_json(stage / "tokenizer.json", runtime_tok)
        phone.copy_side_files(ckpt, stage)
        source = source_record(ckpt)
        runtime = {"runtime": "executorch", "add_bos": int(phone.adds_bos(tok))}
        runtime |= {"stop_ids": spec["eos_ids"], "bos_id": spec["bos_id"], "max_seq_len": seq}
        record = Manifest(
            kind="pte",
            model=name,
            quant=quant,
            vocab_size=ckpt.vocab_size,
            context_length=seq,
            special_tokens=ckpt.special_tokens,
            extra={"checkpoint": source["folder"], "config_sha256": ckpt.config_sha256}
            | {"source": source, "runtime_tokenizer": record, "executorch": runtime}
            | {"built_with": {k: built[k] for k in ("executorch", "torch")}},
        )
        result = record.to_dict()
        result["files"] = file_table(stage)
        write_json(stage / "manifest.json", Manifest.from_dict(result).to_dict())
    log(f"wrote {out / name} ({result['files'][name]['bytes'] / 2**20:.1f} MiB)")
    return result

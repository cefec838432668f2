"""Checkpoint -> LiteRT-LM: DIR/model-<quant>.litertlm (int4 = dynamic_int4_block32, int8 =
dynamic_int8, fp32; export/litertlm_build.py, run in LiteRT-LM's own venv with litert-torch's
converter and LiteRT-LM builder) and manifest.json. The .litertlm file is the whole bundle an app
loads (Android's litertlm-android `Engine`, the Swift API, the AI Edge Gallery apps, the
litert_lm Python and C++ APIs): the TFLite model, tokenizer.json for LiteRT-LM's own HuggingFace
tokenizer, the start token, every stop token (EOS and the chat's end of turn) and the chat
template in LlmMetadata.

LiteRT-LM puts the start token in front itself, so the bundle's start token is the BOS the
tokenizer's post-processor adds (none where it adds none: SmolLM2's chat template writes its
own); its tokenizer is held to `tokenizers`' ids by benchmarks/runtimes/litertlm_bundle.py.

The chat template: LiteRT-LM renders it with minja and hands each message's content to it as a
list of parts ([{"type": "text", "text": ...}]), not the string a Hugging Face template adds to
other strings (`'<|user|>' + message['content']` fails there: "string and sequence"). The bundle
carries the template with each `...['content']` read either way (CONTENT): the string where it
is one, the parts' text joined where it is a list, so the template renders doel-serve's prompt.
"""

from __future__ import annotations

import re
from pathlib import Path

from doel.contracts.manifest import Manifest
from doel.export import phone
from doel.export.checkpoint import source_record
from doel.export.common import file_table, staging, write_json

BUILDER = Path(__file__).with_name("litertlm_build.py")
READ = re.compile(r"""(\bmessages?(?:\[\s*-?\d+\s*\])?)\[\s*(['"])content\2\s*\]""")
CONTENT = (
    "({x}['content'] if {x}['content'] is string else "
    "{x}['content'] | map(attribute='text') | join(''))"
)


def litertlm_template(template: str | None) -> str | None:
    """The chat template with every `message['content']` / `messages[i]['content']` read as a
    string or as LiteRT-LM's list of parts (module docstring)."""
    if template is None:
        return None
    return READ.sub(lambda m: CONTENT.format(x=m.group(1)), template)


def export_litertlm(
    checkpoint: str | Path,
    out: str | Path,
    quant: str = phone.DEFAULT_QUANT,
    force: bool = False,
    tokenizer: str | Path | None = None,
    max_seq_len: int | None = None,
    log=print,
    verify: bool = True,
) -> dict:
    """Write OUT/model-<quant>.litertlm, its tokenizer files and manifest.json, all or nothing
    (module docstring)."""
    ckpt, python, seq, tok = phone.opening(
        checkpoint, "litertlm", "litertlm", quant, tokenizer, max_seq_len, verify
    )
    out, name = Path(out), f"model-{quant}.litertlm"
    start = phone.bos_id(ckpt) if phone.adds_bos(tok) else None
    template = litertlm_template(ckpt.chat_template)
    with staging(out, force) as stage:
        spec = {
            "config": ckpt.config,
            "folder": str(ckpt.folder.resolve()),
            "tokenizer": str(ckpt.tokenizer.resolve()),
            "quant": quant,
            "max_seq_len": seq,
            "bos_id": start,
            "stop_ids": phone.stop_ids(ckpt),
            "chat_template": template,
            "out": str(stage / name),
        }
        log(f"building {name} in {python.parent.parent} ({quant}, {seq} positions)")
        built = phone.run_script(python, BUILDER, spec, stage)
        (stage / "tokenizer.json").write_bytes(ckpt.tokenizer.read_bytes())
        phone.copy_side_files(ckpt, stage)
        source = source_record(ckpt)
        runtime = {"start_id": start, "stop_ids": spec["stop_ids"], "max_seq_len": seq}
        runtime["chat_template"] = "rewritten for content parts" if template else None
        record = Manifest(
            kind="litertlm",
            model=name,
            quant=quant,
            vocab_size=ckpt.vocab_size,
            context_length=seq,
            special_tokens=ckpt.special_tokens,
            extra={"checkpoint": source["folder"], "config_sha256": ckpt.config_sha256}
            | {"source": source, "litertlm": runtime, "built_with": built},
        )
        result = record.to_dict()
        result["files"] = file_table(stage)
        write_json(stage / "manifest.json", Manifest.from_dict(result).to_dict())
    log(f"wrote {out / name} ({result['files'][name]['bytes'] / 2**20:.1f} MiB)")
    return result

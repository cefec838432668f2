"""The bundle's model card: BUNDLE/README.md, so that a bundle folder is a Hugging Face Hub model
repository on its own, published with huggingface_hub's `hf upload` (no doel command needed).

The YAML metadata names the library that runs the files (`onnxruntime` for an ONNX bundle; the
GGUF folder of `--format gguf`: `gguf`), the languages, the license and, when the
checkpoint's repository is known, `base_model`. The body says what is in the folder, how to serve
it, its parity figures from manifest.json and the upload line.

Where the checkpoint's card came from doel (`model_card.json` beside it), its license and its Hub
repository id (`doel-train eval --repo-id`) are read from there, as JSON: export imports
nothing of doel.train. What the checkpoint's card says the same way (the metadata block, the
rule for a repository id, the upload lines) is doel.contracts.card's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from doel.contracts import read_json
from doel.contracts.card import (
    DEFAULT_LICENSE,
    front_matter,
    repo_id_problem,
    repo_or_placeholder,
    upload_lines,
)
from doel.export.common import ExportError


def _tokenizer_line(manifest: dict) -> str:
    pre = manifest.get("pre_tokenizer")
    if pre == "llama":
        return "llama.cpp's SentencePiece vocabulary, the model's `--style spm` tokenizer"
    return f"llama.cpp's `{pre}` pre-tokenizer, the split of the model's `--style gguf` tokenizer"


def check_repo_id(repo_id: str) -> str:
    """`repo_id` if the Hub would take it as a model repository's id; ExportError otherwise."""
    if problem := repo_id_problem(repo_id, "doel-bangla-0.4b-int4-onnx"):
        raise ExportError(problem)
    return repo_id


@dataclass(frozen=True)
class Target:
    """Where a card's folder goes: its name, its Hub repository (YOUR-NAME/NAME until one is
    given), the model it was made from, when its Hub id is known, and the license."""

    folder: str
    repo_id: str | None = None
    base_model: str | None = None
    license: str = DEFAULT_LICENSE
    imported: dict | None = None  # import.json's source: a model doel did not train

    def what(self, otherwise: str) -> str:
        """The sentence's subject: the base model (linked), what an import came from, or a
        Bangla-first model trained with doel."""
        if self.imported:
            return self.base(_origin_sentence(self.imported))
        return f"{self.base(otherwise)}, a Bangla-first language model trained with doel"

    @property
    def repo(self) -> str:
        return repo_or_placeholder(self.repo_id, self.folder)

    def base(self, otherwise: str) -> str:
        """The base model as a link to its Hub page, or `otherwise`."""
        if not self.base_model:
            return otherwise
        return f"[{self.base_model}](https://huggingface.co/{self.base_model})"

    def front_matter(self, library_name: str, tags: list[str]) -> list[str]:
        return front_matter(library_name, self.license, tags, self.base_model)

    def publish_section(self) -> list[str]:
        return [
            "## Publish",
            "",
            f"From the folder above `{self.folder}` (its README.md, this card, becomes the "
            "repository's):",
            "",
            *upload_lines(self.repo, self.folder),
        ]


def source_card(folder: Path) -> dict:
    """What the checkpoint's doel card recorded (model_card.json): license, repo_id. Empty for a
    folder without one, or with a damaged one (the export does not depend on it)."""
    return read_json(folder / "model_card.json") or {}


def imported_from(folder: Path) -> dict:
    """What `doel-train import` recorded of the model a checkpoint came from (import.json's
    `source`): a model someone else trained, whose card must not say doel trained it. Empty
    for a checkpoint doel trained, or a damaged record."""
    record = read_json(folder / "import.json") or {}
    source = record.get("source") if record.get("format") == "doel-import" else None
    return source if isinstance(source, dict) else {}


def _origin_sentence(source: dict) -> str:
    """', imported with `doel-train import` from NAME (by ORG)' for an imported model's card."""
    name = source.get("model_name") or source.get("name") or "another model"
    org = source.get("organization")
    by = f" by {org}" if isinstance(org, str) and org else ""
    return f"the model `{name}`{by}, imported with `doel-train import` from `{source.get('name')}`"


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def parity_rows(parity: dict) -> list[str]:
    """manifest.json's parity figures as a Markdown table, each with its bound."""
    logits, kv, loss = parity["logits_vs_torch"], parity["kv_cache_vs_full"], parity["loss"]
    rows = [
        ("logits vs PyTorch, max relative error", logits["max_rel_err"], logits.get("bound")),
        ("top-1 agreement with PyTorch", logits["top1_agreement"], None),
        ("KV-cache path vs full forward, max relative error", kv["max_rel_err"], kv.get("bound")),
        (
            f"held-out loss increase over {loss['tokens']:,} tokens, nats/token",
            loss["increase_nats_per_token"],
            loss.get("bound_nats_per_token"),
        ),
    ]
    if "ort_format_vs_onnx" in parity:
        ort = parity["ort_format_vs_onnx"]
        rows.append(
            ("model.ort vs model.onnx, max relative error", ort["max_rel_err"], ort["bound"])
        )
    return [
        "| check | value | bound |",
        "|---|---:|---:|",
        *(f"| {name} | {_fmt(v, '.3g')} | {_fmt(b, '.3g')} |" for name, v, b in rows),
    ]


def onnx_card(manifest: dict, to: Target) -> str:
    """README.md of an ONNX export bundle described by `manifest` (export_checkpoint's)."""
    scheme = manifest["quantization"]["scheme"]
    source = manifest["source"]["folder"]
    repo, folder_name = to.repo, to.folder
    arch = ["llama"] if str(manifest.get("architecture", "")).startswith("Llama") else []
    tags = ["doel", *arch, "bangla", "onnx", scheme]
    mobile = (
        " and `model.ort` (the same graph for ONNX Runtime Mobile; "
        f"`{manifest.get('mobile_ops_config') or 'required_operators_and_types.config'}` "
        "lists its operators for a reduced ONNX Runtime build)"
        if manifest.get("mobile_model")
        else ""
    )
    gen_tok = manifest.get("genai_tokenizer") or {}
    genai = (
        "`genai_config.json` for onnxruntime-genai (its own tokenizer gives the ids of "
        "`tokenizers`" + (": `tokenizer_module.json`); " if gen_tok.get("form") == "spm" else "); ")
        if manifest["engine"] == "genai" and gen_tok.get("exact")
        else "`genai_config.json` for onnxruntime-genai (ids from `tokenizers`: its own "
        "tokenizer does not reproduce this one's); "
        if manifest["engine"] == "genai"
        else ""
    )
    parts = [
        to.front_matter("onnxruntime", tags),
        [
            f"# {repo.split('/')[-1]}",
            "",
            f"{to.what(f'The checkpoint `{source}`')}, exported for ONNX Runtime "
            f"on CPU ({scheme}, {manifest['engine']} engine, context "
            f"{manifest['context_length']:,} tokens).",
        ],
        [
            "## Files",
            "",
            f"`model.onnx` (+ `model.onnx.data`): the decoder with a KV cache{mobile}; "
            "`tokenizer.json` with `tokenizer_config.json`, `special_tokens_map.json`, "
            "`config.json` and `generation_config.json` for the Hugging Face tools; "
            f"{genai}"
            "`manifest.json`: inputs and outputs, quantization, the sha256 of every file and the "
            "checks below.",
        ],
        [
            "## Serve",
            "",
            "An OpenAI-compatible server on CPU, without torch:",
            "",
            "```bash",
            "pip install 'doel[serve]'",
            f"hf download {repo} --local-dir {folder_name}",
            f"doel-serve {folder_name}  # http://127.0.0.1:8000/v1",
            "```",
            "",
            "optimum's `ORTModelForCausalLM.from_pretrained` with `AutoTokenizer` loads the folder "
            "as it is.",
        ],
        [
            "## Checks",
            "",
            "Measured against the PyTorch checkpoint when the bundle was written (manifest.json):",
            "",
            *parity_rows(manifest["parity"]),
        ],
        to.publish_section(),
    ]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def gguf_card(manifest: dict, to: Target) -> str:
    """README.md of a `--format gguf` folder described by `manifest` (export_gguf's)."""
    quant, gguf_file = manifest["quant"], manifest["gguf"]
    repo, folder_name = to.repo, to.folder
    template = ", its chat template" if manifest.get("chat_template") else ""
    parts = [
        to.front_matter("gguf", ["doel", "llama", "bangla", "gguf", quant]),
        [
            f"# {repo.split('/')[-1]}",
            "",
            f"{to.what('A checkpoint')}, as GGUF ({quant}) for llama.cpp, Ollama and LM Studio.",
        ],
        [
            "## Files",
            "",
            f"`{gguf_file}`: the weights, the tokenizer ({_tokenizer_line(manifest)}, so "
            f"llama.cpp encodes text to the ids doel's tokenizer.json gives){template}; "
            "`Modelfile`: Ollama's, with the "
            "context and stop token; `manifest.json`: the tensors' types and the sha256 of every "
            "file.",
        ],
        [
            "## Run",
            "",
            "```bash",
            f"llama-server -hf {repo}  # llama.cpp, an OpenAI-compatible server",
            f"ollama run hf.co/{repo}",
            f"ollama create doel -f {folder_name}/Modelfile  # or from the folder itself",
            "```",
        ],
        to.publish_section(),
    ]
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def write_card(
    stage: Path, manifest: dict, folder_name: str, source: Path, repo_id: str | None
) -> Path:
    """Write STAGE/README.md for the bundle (ONNX, or GGUF where the manifest's kind says so)
    that will be named `folder_name`; the checkpoint folder `source` gives the license and,
    when its card recorded one, the base model's id."""
    recorded, imported = source_card(source), imported_from(source)
    base = recorded.get("repo_id") if isinstance(recorded.get("repo_id"), str) else None
    license = next(
        (x for x in (recorded.get("license"), imported.get("license")) if isinstance(x, str)),
        None,
    )
    if imported and not license:
        license = "other"  # not doel's default: the model's own terms apply, and are unknown
    target = Target(folder_name, repo_id, base, license or DEFAULT_LICENSE, imported or None)
    write = gguf_card if manifest.get("kind") == "gguf" else onnx_card
    text = write(manifest, target)
    path = stage / "README.md"
    path.write_text(text, encoding="utf-8")
    return path

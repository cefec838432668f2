"""A model card's Use and Publish sections: load the model from the folder, or from its Hugging
Face Hub repository once one is known (`doel-train eval --repo-id`), and publish it and its
export bundles with huggingface_hub's own `hf upload` (no doel command). Until a repository id
is given, the commands name YOUR-NAME/NAME for the reader to fill in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from doel.contracts.card import repo_id_problem, repo_or_placeholder, upload_lines
from doel.train.common import DoelError

# A training checkpoint's files that only resuming needs: left out of the upload.
RESUME_ONLY = ("optimizer.safetensors", "rng.safetensors", "trainer_state.json", "sharded")


def check_repo_id(repo_id: str) -> str:
    """`repo_id` if the Hub would take it as a model repository's id; DoelError otherwise."""
    if problem := repo_id_problem(repo_id, "doel-bangla-0.4b"):
        raise DoelError(problem)
    return repo_id


def usage_section(folder: Path, name: str, repo_id: str | None) -> list[str]:
    """How to load the model (from the Hub once its repository is known, else from the folder)
    and how to publish it and its export bundles with huggingface_hub's `hf upload`."""
    where = usage_path(folder)
    repo = repo_or_placeholder(repo_id, name)
    source = repo_id or where
    said = (
        f"From the Hugging Face Hub (`{repo_id}`), or the folder it was uploaded from:"
        if repo_id
        else f"The folder is `{where}` from where this card was written (once uploaded to the "
        "Hugging Face Hub, its repository id instead):"
    )
    skip = [
        f'"{n}/*"' if n == "sharded" else f'"{n}"' for n in RESUME_ONLY if (folder / n).exists()
    ]
    exclude = f" --exclude {' '.join(skip)}" if skip else ""
    return [
        "## Use",
        "",
        said,
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tok = AutoTokenizer.from_pretrained({json.dumps(source)})",
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(source)})",
        "```",
        "",
        "## Publish",
        "",
        "With huggingface_hub's own command line; the folder's README.md (this card) becomes the "
        "repository's card. An export bundle is a model repository of its own, with its own card"
        + (
            ""
            if repo_id
            else " (which names this one as its base model once `doel-train eval "
            "--repo-id` has recorded it here)"
        )
        + ":",
        "",
        *upload_lines(
            repo,
            f"{where}{exclude}",
            f"doel-export {where} --out bundle-int4 --quant int4 --repo-id {repo}-int4-onnx",
            f"hf upload {repo}-int4-onnx bundle-int4",
        ),
    ]


def usage_path(folder: Path) -> str:
    """The folder as the user who ran the command reaches it: relative to the working
    directory (`demo/run/final`), so it works pasted where the command ran and names no home
    directory; the folder's own name where no relative path exists (another drive)."""
    try:
        return Path(os.path.relpath(folder.resolve(), Path.cwd().resolve())).as_posix()
    except ValueError:
        return folder.resolve().name

"""What doel's model cards share, whichever stage writes one: the Hugging Face Hub's YAML
metadata block, the Hub's rule for a repository id, the placeholder a reader replaces until an
id is known, and the `hf upload` lines that publish a folder.

Training writes the checkpoint's card (train/evals/modelcard.py), export the bundle's
(export/card.py); both folders are Hub model repositories of their own, and the Hub reads both
cards the same way, so what the Hub requires is said once, here. Standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

PLACEHOLDER_OWNER = "YOUR-NAME"  # what a reader replaces while no --repo-id was given
DEFAULT_LICENSE = "apache-2.0"  # doel's cards' default
LANGUAGES = ("bn", "en")  # a doel model is Bangla-first, with English
# The Hub's rule for a repository id: [owner/]name, letters, digits, '-', '_', '.', at most 96
# characters each, no '--' or '..', not starting or ending with '-' or '.'.
_PART = r"(?!.*(?:--|\.\.))[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}", re.ASCII)
HF_LOGIN = "pip install -U huggingface_hub && hf auth login  # once"


def repo_id_problem(repo_id: str, example: str) -> str | None:
    """None if the Hub would take `repo_id` as a model repository's id; else the one-line
    message that says so, with `example` (a name after YOUR-NAME/) to copy. Each stage raises it
    as its own error."""
    if REPO_ID.fullmatch(repo_id):
        return None
    return (
        f"--repo-id {repo_id!r} is not a Hugging Face repository id: pass OWNER/NAME, "
        f"letters, digits, '-', '_' and '.' (e.g. {PLACEHOLDER_OWNER}/{example})"
    )


def repo_or_placeholder(repo_id: str | None, name: str) -> str:
    """The repository a card names: the given id, or YOUR-NAME/`name` for the reader to fill."""
    return repo_id or f"{PLACEHOLDER_OWNER}/{name}"


def yaml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string is a valid YAML scalar


def front_matter(
    library_name: str,
    license: str,
    tags: Iterable[str],
    base_model: str | None = None,
    more: Iterable[str] = (),
) -> list[str]:
    """The YAML metadata block the Hub reads atop a README.md: languages, license, the library
    that runs the files, the task, the base model when known, the tags, then `more` lines
    (a model-index)."""
    lines = ["---", "language:", *(f"- {lang}" for lang in LANGUAGES)]
    lines += [f"license: {yaml_str(license)}", f"library_name: {library_name}"]
    lines += ["pipeline_tag: text-generation"]
    if base_model:
        lines += ["base_model:", f"- {yaml_str(base_model)}"]
    lines += ["tags:", *(f"- {yaml_str(t)}" for t in tags)]
    return [*lines, *more, "---"]


def upload_lines(repo: str, folder: str, *commands: str) -> list[str]:
    """A bash block: log in once, upload `folder` as the model repository `repo` (its README.md
    becomes the repository's card), then `commands`."""
    return ["```bash", HF_LOGIN, f"hf upload {repo} {folder}", *commands, "```"]

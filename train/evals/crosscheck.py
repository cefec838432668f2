"""The same model folder and the same local files through lm-evaluation-harness (`lm-eval`, in the
dev extra), for the item-by-item cross-check of `train/evals/scoring.py` on HellaSwag and PIQA.

lm-eval runs its own task definitions (the hellaswag.yaml / piqa.yaml it ships, with its own
HellaSwag preprocessing), only pointed at a JSON lines file instead of the hub: nothing is
downloaded (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set). The model is transformers'
LlamaForCausalLM loaded from the folder, the tokenizer PreTrainedTokenizerFast from its
tokenizer.json, both as lm-eval's HFLM loads them. Or another lm-eval model by name (`model`,
`model_args`): `local-completions` against a doel-serve scores a served bundle the same way.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from doel.train.common import DoelError

LM_EVAL_HINT = "pip install 'doel[dev]' (lm-eval is a dev dependency)"


def _docs(task: str, path: Path) -> list[dict]:
    """The task's items as lm-eval's own config expects its dataset rows."""
    from doel.train.evals.tasks import read_jsonl

    if task == "hellaswag":
        docs = read_jsonl(path)
        # A file with only `ctx` (the ../shared/data reconstruction): ctx_a = ctx, ctx_b = ""
        # gives lm-eval's preprocessing the same text (its strip() drops the joining space).
        return [d if "ctx_a" in d else d | {"ctx_a": d["ctx"], "ctx_b": ""} for d in docs]
    if task == "piqa":
        jsonl = path / "valid.jsonl" if path.is_dir() else path
        labels = jsonl.with_name(jsonl.stem + "-labels.lst").read_text(encoding="utf-8").split()
        return [d | {"label": int(g)} for d, g in zip(read_jsonl(jsonl), labels)]
    raise DoelError(f"the lm-eval cross-check covers hellaswag and piqa, not {task!r}")


def lm_eval_choices(
    folder: str | Path,
    task: str,
    path: str | Path,
    limit: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    model: str | None = None,
    model_args: dict | None = None,
) -> list[dict]:
    """lm-eval's verdict per item, in file order: {"lls": choice log-likelihoods, "acc",
    "acc_norm"}. `task` is hellaswag or piqa; `path` as `train.evals.tasks.load_task` takes it.
    With `model` (an lm-eval model name), that model with `model_args` scores instead of
    transformers over `folder`."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import lm_eval
        from lm_eval.api.task import ConfigurableTask
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks._yaml_loader import load_yaml
    except ModuleNotFoundError as e:
        raise DoelError(f"the cross-check needs {e.name!r}: {LM_EVAL_HINT}") from None

    docs = _docs(task, Path(path))[:limit]
    with tempfile.TemporaryDirectory(prefix="doel-lmeval-") as tmp:
        data = Path(tmp) / "validation.jsonl"
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks" / task / f"{task}.yaml")
        cfg |= {
            "task": f"doel_local_{task}",
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(data)}, "cache_dir": tmp},
            "training_split": None,
            "validation_split": "validation",
            "test_split": None,
        }
        if model is None:
            lm = HFLM(pretrained=str(folder), device=device, batch_size=batch_size, dtype="float32")
        out = lm_eval.simple_evaluate(
            model=lm if model is None else model,
            model_args=model_args,
            tasks=[ConfigurableTask(config=cfg)],
            log_samples=True,
            bootstrap_iters=0,
        )
    samples = sorted(out["samples"][cfg["task"]], key=lambda s: s["doc_id"])
    return [
        {
            "lls": [float(ll) for ll, _ in s["filtered_resps"]],
            "acc": s["acc"],
            "acc_norm": s["acc_norm"],
        }
        for s in samples
    ]

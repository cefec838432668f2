"""Chat fine-tuning of an adapted model in the base's own chat template (SmolLM2: ChatML), on
`sft`'s skeleton (train/job.py, build.py, sft.py's ChatLoop and the ChatLoader).

`doel-train sft` renders doel's template with doel's turn markers; a model someone else trained
keeps its own (docs/adapt.md), so here a conversation is rendered by the base's template itself
(tokenizer_config.json's `chat_template`, run by jinja2 as transformers runs it) and encoded
whole by the adapted tokenizer, and the loss is taken on the characters of each assistant turn:
what the template adds after rendering the conversation up to that turn with
`add_generation_prompt`, the reply and its end-of-turn token. A template whose rendering of a
longer conversation does not begin with the rendering of a shorter one has no such turns and
is refused. A message that spells one of the vocabulary's special tokens is dropped and
counted, so that no conversation can inject a turn. The checks before step 1 are the
gradient-flow gate and a loss-mask check (the tokens the loss is on decode to the replies).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from doel.train.adapt.init import keep_tokenizer_files
from doel.train.build import build_parts
from doel.train.common import DoelError
from doel.train.data.chat import IGNORE, ChatData, ChatLoader
from doel.train.data.conversations import SFTConfig, iter_conversations
from doel.train.data.textio import resolve_sources
from doel.train.hf import load_model, read_config
from doel.train.job import Checks, Job, gradient_gate, launch
from doel.train.sft import ChatLoop


class Template:
    """The base's chat template and vocabulary: conversations -> (ids, loss mask)."""

    def __init__(self, model_dir: Path):
        side = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = side.get("chat_template")
        if not isinstance(source, str):
            raise DoelError(f"{model_dir}: no chat template; chat fine-tuning keeps the base's")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.extra = {
            k: side[k] for k in ("bos_token", "eos_token") if isinstance(side.get(k), str)
        }
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        added = json.loads(self.tok.to_str()).get("added_tokens") or []
        self.specials = [a["content"] for a in added if a.get("special")]
        self.pad = read_config(model_dir).pad_token_id

    def text(self, messages: list[dict], prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=prompt, **self.extra)

    def render(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, mask) of one conversation; None when a message spells a special token."""
        if any(s in str(m.get("content") or "") for m in messages for s in self.specials):
            return None
        full, spans = self.text(messages), []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, upto = self.text(messages[:k], prompt=True), self.text(messages[: k + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DoelError("the base's chat template is not prefix-stable; cannot find turns")
            spans.append((len(before), len(upto)))
        enc = self.tok.encode(full, add_special_tokens=False)
        mask = np.array([any(a <= s < b for a, b in spans) for s, _ in enc.offsets], dtype=bool)
        return np.array(enc.ids, dtype=np.int64), mask


def _raise(message):
    raise DoelError(f"the chat template refused a conversation: {message}")


def load_data(specs: list[str], tmpl: Template, cfg: SFTConfig, log) -> tuple[ChatData, ChatData]:
    """Read and render the conversations; every `holdout_every`-th is held out."""
    stats = {"conversations": 0, "truncated": 0, "dropped": 0, "sources": {}}
    train, held = ChatData(), ChatData()
    for _, _, messages in iter_conversations(resolve_sources(specs), cfg, stats):
        got = tmpl.render(messages)
        if got is None or not got[1][1 : cfg.seq_len + 1].any():
            stats["dropped"] += 1
            continue
        seq, mask = got
        if len(seq) > cfg.seq_len + 1:
            seq, mask = seq[: cfg.seq_len + 1], mask[: cfg.seq_len + 1]
            stats["truncated"] += 1
        n = stats["conversations"] = stats["conversations"] + 1
        part = held if cfg.holdout_every and n % cfg.holdout_every == 0 else train
        part.ids.append(seq)
        part.masks.append(mask)
        if cfg.max_conversations and n >= cfg.max_conversations:
            break
    stats |= {"train": len(train.ids), "heldout": len(held.ids)}
    stats["tokens"] = int(sum(len(a) for a in train.ids))
    train.stats = held.stats = stats
    log(f"chat data (the base's template): {stats}")
    if not train.ids:
        raise DoelError(f"no conversation to train on in {', '.join(specs)}")
    return train, held


def check_mask(tmpl: Template, data: ChatData, loader: ChatLoader) -> str:
    """The targets of the first conversation's row decode to its assistant text, nothing else."""
    x, y = loader.row(0)
    kept = [int(t) for t in y if t != IGNORE]
    want = [int(t) for t, m in zip(data.ids[0][1:], data.masks[0][1:]) if m][: len(kept)]
    if not kept or kept != want:
        raise DoelError("loss-mask check failed: the targets are not the assistant's tokens")
    return tmpl.tok.decode(kept, skip_special_tokens=False)


def chat_finetune(
    cfg: SFTConfig, base: Path, data: list[str], out: Path, log=print, **asked
) -> Path:
    """Fine-tune the model folder `base` on conversations in its own template; returns
    out/final (with the base's tokenizer files). A rerun resumes from out's last checkpoint."""
    try:
        cfg = dataclasses.replace(cfg, model=read_config(base))
    except ValueError as e:
        raise DoelError(f"invalid [chat] config with the model of {base}: {e}") from None
    final = launch(
        cfg, out, lambda job: _chat(job, cfg, base, data), command="adapt", log=log, **asked
    )
    return keep_tokenizer_files(final, base)


def _chat(job: Job, cfg: SFTConfig, base: Path, data: list[str]) -> Path:
    job.prepare(cfg)
    tmpl, log = Template(base), job.log
    train, held = load_data(data, tmpl, cfg, log)
    special = {"pad": tmpl.pad}
    info = job.info
    parts = build_parts(
        cfg, None, model_factory=lambda c: load_model(base, job.device),
        loader_factory=lambda: ChatLoader(train, cfg.batch_size, cfg.seq_len, cfg.seed, special,
                                          info.rank, info.world_size),
        info=info, device=job.device, resume_from=job.resume_from, describe_to=log, log=log,
        checksums=not job.no_checksums,
    )  # fmt: skip

    def perform(_out):
        gradient_gate(parts, log)
        reply = check_mask(tmpl, train, parts.make_loader())
        log(f"  pass loss_mask     the loss is on the replies only: {reply[:60]!r}")

    checks = Checks(perform=perform, inputs=lambda: {"data_sha256": train.fingerprint()},
                    skipped="the loss-mask check did not run")  # fmt: skip
    return job.train(parts, checks, tok_path=base / "tokenizer.json", meta={}, loop=ChatLoop,
                     held=held, special=special)  # fmt: skip

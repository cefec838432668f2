"""Chat fine-tuning data (`doel-train sft`): conversations (read and checked by
`iter_conversations`) rendered to token ids with the mask of the tokens the loss is taken on,
and served in padded batches; the run's tokenizer with the turn markers.

Rendering is the template in tokenizer_config.json (the tokenizer's `CHAT_TEMPLATE`)
written out in ids, with no Jinja: <|bos|>, then <|role|> text <|end|> a turn (`turn_texts`:
a message's content; the tools block in the system turn, an assistant's <tool_call>s after its
content, a tool's result as a user turn in <tool_response>). The loss is taken on each
assistant turn's text (content and tool calls) and its closing <|end|> (the model learns to
answer, to call, and to stop), never on system, user or tool text or the role markers.
Content that spells a marker ("<|end|>") is plain text here, as everywhere in doel, so no
message can inject a turn.

Why padded batches, one conversation a row: the model (train/model.py) has no attention mask or
position ids, so two conversations packed in a row would attend to each other. Padding after
the conversation needs neither: attention is causal, so no real token sees a pad, and pads are
never targets. Rows are padded to seq_len, one shape for torch.compile and the checks; the pad
share is logged, and a context close to the data's lengths keeps it small.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from doel.train.common import DoelError, atomic_write_bytes
from doel.train.data.conversations import Conversation as Conversation  # a tools holder
from doel.train.data.conversations import SFTConfig, iter_conversations
from doel.train.data.conversations import check_messages as check_messages  # tests read it here
from doel.train.data.textio import SUFFIXES, resolve_sources
from doel.train.data.tokenizer import (
    BOS,
    CHAT_TOKENS,
    PAD,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_RESPONSE,
    TOOL_RESPONSE_END,
    TOOLS_HEADER,
    load_tokenizer,
    tokenizer_file,
    write_hf_side_files,
)

IGNORE = -100  # the model's IGNORE_INDEX (kept torch-free here: the model imports torch)
FIRST_MARKER_ID = 3  # <|system|> <|user|> <|assistant|> <|end|> hold ids 3-6 in every vocabulary


# ------------------------------------------------------------------ rendering


def special_ids(tok) -> dict[str, int]:
    """The ids of <|bos|>, <|pad|> and the four turn markers; a vocabulary without the markers
    is refused (chat_tokenizer renames an older one's reserved tokens)."""
    names = {
        "bos": BOS,
        "pad": PAD,
        **dict(zip(("system", "user", "assistant", "end"), CHAT_TOKENS)),
    }
    ids = {k: tok.token_to_id(t) for k, t in names.items()}
    missing = [names[k] for k, v in ids.items() if v is None]
    if missing:
        raise DoelError(
            f"the tokenizer lacks {missing}: chat needs a doel vocabulary with the turn markers "
            "(doel-train sft renames an older vocabulary's <|reserved_0..3|>)"
        )
    return ids


def render(tok, messages: list[dict], ids: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The template's token ids for a conversation and the loss mask (True on each assistant
    message's content and its <|end|>): what apply_chat_template(messages) gives, in ids."""
    return render_many(tok, [messages], ids)[0]


def render_many(tok, conversations: list[list[dict]], ids: dict | None = None):
    """`render` for many conversations, their turns' texts encoded in one batch."""
    ids = ids or special_ids(tok)
    turns = [turn_texts(conv) for conv in conversations]
    texts = [text for conv in turns for _, text in conv]
    encoded = iter(tok.encode_batch(texts, add_special_tokens=False))
    out = []
    for conv in turns:
        seq, mask = [ids["bos"]], [False]
        for role, _ in conv:
            body = next(encoded).ids
            learn = role == "assistant"
            seq += [ids[role], *body, ids["end"]]
            mask += [False] + [learn] * (len(body) + 1)
        out.append((np.asarray(seq, dtype=np.int32), np.asarray(mask, dtype=bool)))
    return out


def turn_texts(conv: list[dict]) -> list[tuple[str, str]]:
    """(role marker, text) of each turn, as CHAT_TEMPLATE prints them: a conversation with
    tools (a Conversation's `tools`) opens with a system turn of its system content, then the
    tools block; a tool's result is a user turn."""
    tools = getattr(conv, "tools", None)
    messages = list(conv)
    turns = []
    if tools:
        system = ""
        if messages[0]["role"] == "system":
            system = messages.pop(0)["content"] + "\n\n"
        lines = "".join(_json(tool_definition(t.get("function", t))) + "\n" for t in tools)
        turns.append(("system", system + TOOLS_HEADER + lines))
    for m in messages:
        if m["role"] == "tool":
            turns.append(("user", TOOL_RESPONSE + m["content"] + TOOL_RESPONSE_END))
        elif m.get("tool_calls"):
            calls = "".join(TOOL_CALL + call_text(c) + TOOL_CALL_END for c in m["tool_calls"])
            turns.append(("assistant", (m.get("content") or "") + calls))
        else:
            turns.append((m["role"], m["content"]))
    return turns


def tool_definition(f: dict) -> dict:
    """A function as the template shows it: its name, description and parameters, "" and {}
    where absent (llama-server's form of an OpenAI tool), nothing else."""
    described = {"description": f.get("description", ""), "parameters": f.get("parameters", {})}
    return {"name": f["name"]} | described


def call_text(call: dict) -> str:
    """A tool call as the template writes it: {"name": ..., "arguments": ...}."""
    f = call.get("function", call)
    if isinstance(f["arguments"], str):
        return '{"name": ' + _json(f["name"]) + ', "arguments": ' + f["arguments"] + "}"
    return _json({"name": f["name"], "arguments": f["arguments"]})


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' tojson filter


# ------------------------------------------------------------------ the data of a run


@dataclass
class ChatData:
    """Rendered conversations (ids and loss mask each) and what reading them found."""

    ids: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for a, m in zip(self.ids, self.masks, strict=True):
            h.update(a.tobytes())
            h.update(np.packbits(m).tobytes())
        return h.hexdigest()


def load_chat_data(
    specs: list[str], tok, cfg: SFTConfig, log=print, batch: int = 1024
) -> tuple[ChatData, ChatData]:
    """Read, check and render the conversations of `specs`; return (train, held-out). A
    conversation over seq_len + 1 tokens is truncated there (or dropped, overlong="drop"); one
    with no assistant token left in the context is dropped. Both are counted and logged."""
    sources = resolve_sources(specs)
    for src in sources:
        if src.paths[0].startswith("hf:"):
            continue
        bad = [p for p in src.paths if not p.endswith((".jsonl", ".parquet"))]
        if bad:
            raise DoelError(
                f"{bad[0]}: chat data must be .jsonl or .parquet (one conversation a row: "
                f'{{"messages": [...]}}); folders are read for {", ".join(SUFFIXES[1:])} files'
            )
    ids = special_ids(tok)
    limit = cfg.seq_len + 1
    stats = {"conversations": 0, "truncated": 0, "dropped": 0, "sources": {}}
    train, held = ChatData(), ChatData()
    pending: list[tuple[str, list[dict]]] = []

    def flush():
        for (name, _), (seq, mask) in zip(pending, render_many(tok, [m for _, m in pending], ids)):
            if len(seq) > limit:
                if cfg.overlong == "drop":
                    stats["dropped"] += 1
                    continue
                seq, mask = seq[:limit], mask[:limit]
                if not mask[1:].any():  # nothing of the assistant's within the context
                    stats["dropped"] += 1
                    continue
                stats["truncated"] += 1
            n = stats["conversations"]
            stats["conversations"] += 1
            stats["sources"][name] = stats["sources"].get(name, 0) + 1
            part = (
                held
                if cfg.holdout_every and n % cfg.holdout_every == cfg.holdout_every - 1
                else train
            )
            part.ids.append(seq)
            part.masks.append(mask)
        pending.clear()

    for name, _, messages in iter_conversations(sources, cfg, stats):
        pending.append((name, messages))
        if len(pending) >= batch:
            flush()
        if cfg.max_conversations and stats["conversations"] + len(pending) >= cfg.max_conversations:
            break
    flush()
    stats["train"], stats["heldout"] = len(train.ids), len(held.ids)
    stats["tokens"] = int(sum(len(a) for a in train.ids))
    stats["assistant_tokens"] = int(sum(int(m.sum()) for m in train.masks))
    train.stats = held.stats = stats
    log(describe_data(stats, cfg))
    if not train.ids:
        raise DoelError(
            f"no conversation to train on in {', '.join(specs)} ({describe_data(stats, cfg)})"
        )
    return train, held


def describe_data(stats: dict, cfg: SFTConfig) -> str:
    text = (
        f"chat data: {stats['conversations']:,} conversations ({stats.get('train', 0):,} to train, "
        f"{stats.get('heldout', 0):,} held out), {stats.get('tokens', 0):,} tokens of which "
        f"{stats.get('assistant_tokens', 0):,} are the assistant's (the loss is on those); "
        f"{stats['truncated']:,} truncated to the {cfg.seq_len + 1}-token context, "
        f"{stats['dropped']:,} dropped (overlong={cfg.overlong})"
    )
    if stats.get("filtered"):
        text += f"; {stats['filtered']:,} rows left out by keep_rows={cfg.keep_rows}"
    if stats.get("malformed"):
        text += f"; {stats['malformed']:,} malformed skipped (first: {stats['first_malformed']})"
    return text


# ------------------------------------------------------------------ batches


class ChatLoader:
    """Padded batches of whole conversations, one a row: inputs (B, seq_len) padded with
    <|pad|>, targets the next tokens where the mask says so and IGNORE elsewhere. The order is
    drawn from (seed, epoch) and the position is (epoch, cursor), so it resumes exactly (the
    same state_dict keys as TokenLoader's); ranks take slices of one global batch."""

    def __init__(self, data: ChatData, batch_size, seq_len, seed, special, rank=0, world_size=1):
        self.data, self.special = data, special
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.split, self.rank, self.world_size = "chat", rank, world_size
        self.global_batch = batch_size * world_size
        self.n_windows = len(data.ids)
        if self.n_windows < self.global_batch:
            raise DoelError(
                f"{self.n_windows} conversations to train on, fewer than one global batch of "
                f"{self.global_batch}; lower batch_size or add conversations"
            )
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        seq, mask = self.data.ids[i], self.data.masks[i]
        x = np.full(self.seq_len, self.special["pad"], dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        m, n = min(len(seq), self.seq_len), min(len(seq) - 1, self.seq_len)
        x[:m] = seq[:m]  # the last token too: every target is then the next input
        y[:n] = np.where(mask[1 : n + 1], seq[1 : n + 1], IGNORE)
        return x, y

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        if self.cursor + self.global_batch > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        start = self.cursor + self.rank * self.batch_size
        idx = self._perm[start : start + self.batch_size]
        self.cursor += self.global_batch
        rows = [self.row(int(i)) for i in idx]
        return np.stack([x for x, _ in rows]), np.stack([y for _, y in rows])

    def peek(self, n: int = 1):
        state = self.state_dict()
        try:
            return [self.next_batch() for _ in range(n)]
        finally:
            self.load_state_dict(state)

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every conversation once, in order (the last batch may be short): validation."""
        for start in range(0, self.n_windows, self.batch_size):
            rows = [self.row(i) for i in range(start, min(start + self.batch_size, self.n_windows))]
            yield np.stack([x for x, _ in rows]), np.stack([y for _, y in rows])

    def state_dict(self) -> dict:
        return {
            "split": self.split,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "conversations": self.n_windows,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("split", "seed", "seq_len", "global_batch", "conversations"):
            if state.get(key) != getattr(self, key if key != "conversations" else "n_windows"):
                raise DoelError(
                    f"loader state was saved with {key}={state.get(key)!r}, this run has "
                    f"{getattr(self, key if key != 'conversations' else 'n_windows')!r}; resume "
                    "with the same data and settings (or --fresh)"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)


# ------------------------------------------------------------------ the run's tokenizer


def chat_tokenizer(base, out_dir, log=print) -> Path:
    """The base checkpoint's tokenizer.json, written to out_dir with its HF side files (the
    chat template among them). A vocabulary made before chat has <|reserved_0..3|> at ids 3-6:
    they are renamed to the turn markers (no merge builds them and no text encodes to them, so
    every other id is unchanged). Any other vocabulary there is refused."""
    src = tokenizer_file(base)
    if not src.is_file():
        raise DoelError(
            f"{base}: no tokenizer.json; a base checkpoint made by doel-train carries one"
        )
    data = json.loads(src.read_text(encoding="utf-8"))
    added = {a["id"]: a for a in data["added_tokens"]}
    at = {i: added[i]["content"] if i in added else None for i in range(3, 7)}
    want = dict(zip(range(FIRST_MARKER_ID, FIRST_MARKER_ID + 4), CHAT_TOKENS))
    old = {i: f"<|reserved_{i - FIRST_MARKER_ID}|>" for i in want}
    if at == old:
        vocab = data["model"]["vocab"]
        for i, name in want.items():
            added[i]["content"] = name
            vocab[name] = vocab.pop(old[i])
        log(
            f"tokenizer: {src} predates the chat markers; ids 3-6 (<|reserved_0..3|>) are named "
            f"{' '.join(CHAT_TOKENS)} in this run's tokenizer, so the chat template applies"
        )
    elif at != want:
        raise DoelError(
            f"{src}: ids 3-6 are {list(at.values())}, neither doel's turn markers nor the reserved "
            "tokens they replace; chat fine-tuning needs a doel vocabulary"
        )
    out = Path(out_dir)
    atomic_write_bytes(
        out / "tokenizer.json", json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")
    )
    write_hf_side_files(out)
    load_tokenizer(out)  # refuse to go on with a file that does not load
    return out / "tokenizer.json"

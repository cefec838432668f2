"""The engine: one ONNX Runtime session over an export bundle, token ids in, token ids out.

It knows nothing of text. A request is a prefill (the prompt, in runs of PREFILL_CHUNK tokens:
see Engine.forward) and then one run per new token through the KV cache; with several slots,
one run steps many sequences (the `Scheduler` decides which). For the
builder's graphs (manifest `past_present_share_buffer`) the cache is one buffer per layer,
reserved once at the full context length and bound as both `past_key_values.*` input and
`present.*` output: GroupQueryAttention writes each new entry in place and reads only the first
`attention_mask` positions, so no step copies or reallocates the cache (a cache grown by
concatenation is copied whole at every token, a cost that grows with the context), and stale
entries from an earlier request are never read. Other graphs (optimum's) get the growing cache
they were built for, one slot only, and every entry point takes them there: `forward`, `decode`
(the Scheduler steps every bundle through it), `release` (which shortens or drops that cache)
and `warm_up`; one of them bound to the shared buffer would run without the `position_ids` such
a graph needs and fail at its second token.

The buffer is reserved, not held: a private anonymous mapping in small pages (`kv_buffer`), so
memory is taken only where a run writes, a page of positions at a time, and `release` gives a
slot's pages past what it still holds back to the system. Memory thus follows the positions in
use, as a paged cache's does, while each slot stays one strided row that attention reads in place
(numpy's own large arrays ask for 2 MB pages, and one entry written per slot then took every
slot's whole context: docs/serving.md#memory). Private, because only there does giving back
free anything: Python's `mmap.mmap(-1, n)` alone is MAP_SHARED, whose pages live in the kernel's
shmem, and MADV_DONTNEED on them drops the mapping but keeps the pages (and their old contents),
so the process's resident memory fell while the machine's stayed at its high-water mark.
doel.contracts.memory measures what the system pays (Pss), and flags such mappings.
The weights go the other way: once the session has repacked them, what building it mapped is
moved onto 2 MB pages (hugepages.py), since every decode step streams them all.

Bundles whose graph takes `logits_to_keep` are asked for the last position's logits only, the
prompt's included, into one preallocated buffer.

The bundle's manifest.json is read through doel.contracts.manifest: a folder this engine cannot
run (a GGUF for llama.cpp, a manifest newer than this doel, a damaged one) is a BundleError in
one line that says what the folder is and what to do. The folder may be a stranger's: its
manifest's sizes are bounded by the contract, the files it reads must lie in the folder (no
symlink out), tokenizer.json's counts and pipeline are bounded (doel.contracts.untrusted), and
the KV cache the manifest asks for must fit this machine's memory, all before anything is
allocated.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from doel.contracts import untrusted
from doel.contracts.manifest import ManifestError, read_manifest
from doel.contracts.quant import KV_DTYPES
from doel.serve.core import hugepages
from doel.serve.core.sampling import SamplingParams, sample

LAST = np.array([1], np.int64)  # logits_to_keep: the last position only
ALL = np.array([0], np.int64)  # logits_to_keep: every position (a scored prompt, `echo`)
PREFILL_CHUNK = 128  # prompt tokens per run (see Engine.forward)


class BundleError(Exception):
    """The folder is not a usable export bundle; the message says what is wrong."""


@dataclass(frozen=True)
class Bundle:
    """What the engine reads from manifest.json."""

    folder: Path
    model: Path
    tokenizer: Path
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    share_buffer: bool
    position_ids: bool
    special_tokens: dict
    manifest: dict

    @property
    def eos_id(self) -> int | None:
        eos = self.special_tokens.get("eos")
        return eos["id"] if eos else None


PHONE_HINT = (
    "{folder} holds {model} for a phone runtime ({kind}): run it with that runtime "
    "(docs/phones.md), or export an ONNX bundle with doel-export CHECKPOINT --out DIR"
)
GGUF_HINT = (
    "{folder} holds a GGUF for llama.cpp ({gguf}): run it with llama-server or Ollama, or export "
    "an ONNX bundle with doel-export CHECKPOINT --out DIR"
)


def read_bundle(folder: str | Path) -> Bundle:
    """The bundle in `folder`, checked; BundleError (one line: what the folder is, what to do)
    for a folder this engine cannot run."""
    folder = Path(folder)
    path = folder / "manifest.json"
    ggufs = [] if path.exists() or not folder.is_dir() else sorted(folder.glob("*.gguf"))
    if ggufs:  # never opened: doel reads no GGUF
        raise BundleError(GGUF_HINT.format(folder=folder, gguf=ggufs[0].name))
    try:
        m = read_manifest(folder)
    except ManifestError as e:
        raise BundleError(str(e)) from None
    except (AttributeError, TypeError) as e:
        # A field of the wrong JSON type where the contract reads a mapping (a list for
        # kv_cache, a string for quantization) escapes Manifest.from_dict's own checks.
        raise BundleError(f"{path} is damaged ({type(e).__name__}: {e}); export again") from None
    if m.kind == "gguf":
        raise BundleError(GGUF_HINT.format(folder=folder, gguf=m.gguf))
    if m.kind != "onnx":  # a phone runtime's folder (--format pte / litertlm: docs/phones.md)
        raise BundleError(PHONE_HINT.format(folder=folder, kind=m.kind, model=m.model))
    if m.context_length is None:  # optional in the contract, needed here
        raise BundleError(f"{path} has no context_length; export the bundle again")
    kv = m.kv_cache
    try:
        bundle = Bundle(
            folder=folder,
            model=folder / m.model,
            tokenizer=folder / "tokenizer.json",
            layers=int(kv.layers),
            kv_heads=int(kv.kv_heads),
            head_dim=int(kv.head_dim),
            vocab_size=int(m.vocab_size),
            context_length=int(m.context_length),
            share_buffer=bool(kv.past_present_share_buffer),
            position_ids=bool(kv.position_ids_input),
            special_tokens=dict(m.special_tokens),
            manifest=m.to_dict(),
        )
    except (ValueError, TypeError) as e:
        raise BundleError(f"{path} is not a doel-export manifest ({type(e).__name__}: {e})") from e
    for f in (bundle.model, bundle.tokenizer):
        if not f.is_file():
            raise BundleError(f"the bundle {folder} lacks {f.name}; export it again")
    try:
        _untrusted(bundle)
    except untrusted.UntrustedError as e:
        raise BundleError(str(e)) from None
    return bundle


def _untrusted(b: Bundle) -> None:
    """What a stranger's bundle could make serve read or allocate, bounded (module docstring)."""
    for f in (b.model, b.model.with_name(b.model.name + ".data"), b.tokenizer):
        if f.exists() or f.is_symlink():
            untrusted.inside(b.folder, f, f"the bundle's {f.name}")
    config = b.folder / "tokenizer_config.json"
    if config.exists() or config.is_symlink():
        untrusted.inside(b.folder, config, "the bundle's tokenizer_config.json")
        untrusted.file_bytes(config, untrusted.MAX_RECORD_BYTES)
    untrusted.check_tokenizer(b.tokenizer)
    dtype = b.manifest["kv_cache"].get("dtype")
    per = np.dtype(dtype).itemsize if dtype in KV_DTYPES.values() else 4
    cache = b.layers * 2 * b.kv_heads * b.context_length * b.head_dim * per
    memory = untrusted.memory_bytes()
    if memory is not None and cache > memory:
        raise untrusted.UntrustedError(
            f"{b.folder / 'manifest.json'} kv_cache and context_length ask for a KV cache of "
            f"{cache / 2**30:,.1f} GiB a slot (layers × 2 × kv_heads × context_length × head_dim "
            f"× {per} bytes), more than this machine's {memory / 2**30:,.1f} GiB of memory; "
            "serve it on a larger machine, or export it with a shorter context"
        )


PAGE = mmap.PAGESIZE


def kv_buffer(shape: tuple[int, ...], dtype) -> tuple[np.ndarray, mmap.mmap]:
    """Zeros of `shape` in a private anonymous mapping of small pages, and the mapping: the
    system gives a page memory when it is first written, and takes it back at `give_back` (the
    module docstring says why private)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    # With no file, MAP_PRIVATE is MAP_PRIVATE | MAP_ANONYMOUS. Windows has no flags: its
    # anonymous mappings are private already (and it has no MADV_DONTNEED either).
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    buf = mmap.mmap(-1, max(n, 1), **private)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere the system's default pages
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count=int(np.prod(shape))).reshape(shape), buf


def give_back(buf: mmap.mmap, lo: int, hi: int) -> None:
    """Return the whole pages within bytes lo..hi of `buf` (a `kv_buffer` mapping: private and
    anonymous) to the system: freed, not only unmapped, and they read as zeros after. Where the
    system cannot (no MADV_DONTNEED), nothing happens: what a slot holds past its length is
    never read, so correctness does not depend on it."""
    lo, hi = -(-lo // PAGE) * PAGE, hi // PAGE * PAGE
    if hi > lo and hasattr(mmap, "MADV_DONTNEED"):
        buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _positions_last(dims: list) -> bool:
    """Whether a cache input [batch, heads, ., .] has its (symbolic) sequence axis last."""
    return isinstance(dims[3], str) and "sequence" in dims[3]


class Engine:
    """Sequences in `slots` rows of one preallocated cache. `generate` runs one request in slot 0
    (the caller serialises requests); `forward(slot=)` and `decode` let a scheduler prefill a
    slot while others wait and then step all slots 0..n-1 in one batched run."""

    def __init__(
        self,
        bundle: Bundle,
        threads: int,
        slots: int = 1,
        profile: bool = False,
        session_config: dict[str, str] | None = None,
    ):
        if slots > 1 and not bundle.share_buffer:
            raise BundleError("batched slots need a graph with a shared KV buffer (genai engine)")
        self.bundle, self.slots = bundle, slots
        self.prefill_chunk = PREFILL_CHUNK
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads  # 0: one per core
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # ONNX Runtime's own session options (benchmarks/probes/probe_ort_options.py measures them)
        for key, value in (session_config or {}).items():
            opts.add_session_config_entry(key, value)
        # Errors only: ONNX Runtime warns at every load that the overridable logits_to_keep
        # input is not folded as a constant, which is its point.
        opts.log_severity_level = 3
        opts.enable_profiling = profile  # per-operator times (benchmarks/serve/profile_serve.py)
        runs, before = hugepages.steps_now(), hugepages.snapshot()
        self.session = ort.InferenceSession(
            str(bundle.model), opts, providers=["CPUExecutionProvider"]
        )
        # Its weights are repacked now: what building it mapped goes onto 2 MB pages
        # (serve/core/hugepages.py), before the KV cache is reserved in small ones; not if
        # another engine ran meanwhile, whose buffers would pass for this session's.
        alone = runs is not None and hugepages.steps_now() == runs
        self.huge_bytes = hugepages.collapse(since=before) if alone else 0
        optional = {i.name for i in self.session.get_overridable_initializers()}
        self.last_only = "logits_to_keep" in optional
        self._last = ort.OrtValue.ortvalue_from_numpy(LAST)
        self._all = ort.OrtValue.ortvalue_from_numpy(ALL)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        # fp32, or fp16 / int8 where the export keeps the cache so (doel-export --kv-cache)
        self.kv_dtype = np.dtype(KV_DTYPES[inputs[self.past_names[0]].type]).type
        self.present_names = [n.replace("past_key_values.", "present.", 1) for n in self.past_names]
        # Reserved here, once: every request reuses them (see the module docstring). A slot's
        # rows are contiguous (batch is the outer axis), so slots lo..lo+n-1 are a plain view.
        # ONNX Runtime's session.gqa_value_layout=BNHS asks for the value cache positions-last
        self._positions_last = [_positions_last(inputs[n].shape) for n in self.past_names]
        made = [kv_buffer(self._cache_shape(t), self.kv_dtype) for t in self._positions_last]
        self.kv_arrays = [a for a, _ in made]
        self._maps = [m for _, m in made]
        self.logits_array = np.zeros((slots, 1, bundle.vocab_size), np.float32)
        self._view_cache: dict[tuple[int, int], tuple[list, object]] = {}
        self.kv = self._views(0, slots)[0]
        self.binding = self.session.io_binding()
        self._past: dict[str, np.ndarray] = {}

    def _cache_shape(self, positions_last: bool) -> tuple[int, int, int, int]:
        """[slots, kv heads, positions, head dim], or with the positions last."""
        b = self.bundle
        if positions_last:
            return (self.slots, b.kv_heads, b.head_dim, b.context_length)
        return (self.slots, b.kv_heads, b.context_length, b.head_dim)

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` cache positions of slot `src` to slot `dst` (the scheduler parks a
        held prefix there)."""
        if not self.bundle.share_buffer:
            raise ValueError("a graph with a growing cache has one slot: nothing to copy")
        for a, last in zip(self.kv_arrays, self._positions_last):
            if last:  # _cache_shape
                a[dst, :, :, :n] = a[src, :, :, :n]
            else:
                a[dst, :, :n] = a[src, :, :n]

    def release(self, slot: int, keep: int = 0) -> None:
        """Give the memory of `slot`'s cache past its first `keep` positions back to the
        system (whole pages; with the value cache positions-last, only a whole slot). Call only
        between runs: a run writing the slot meanwhile could lose its entries. On a growing
        cache, it keeps that cache's first `keep` positions and frees the rest."""
        self._check_slot(slot)
        if not self.bundle.share_buffer:
            self._past = {n: v[:, :, :keep].copy() for n, v in self._past.items()} if keep else {}
            return
        for a, buf, last in zip(self.kv_arrays, self._maps, self._positions_last):
            row = a[slot]
            start = row.ctypes.data - a.ctypes.data
            if keep == 0:
                give_back(buf, start, start + row.nbytes)
            elif not last:  # each head's positions are one run of bytes
                per_head = row.nbytes // row.shape[0]
                per_position = per_head // row.shape[1]
                for h in range(row.shape[0]):
                    lo = start + h * per_head
                    give_back(buf, lo + keep * per_position, lo + per_head)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} of {self.slots}")

    @property
    def context_length(self) -> int:
        return self.bundle.context_length

    def warm_up(self) -> None:
        """One prefill chunk in slot 0 and one step of every slot, once, at load: ONNX Runtime
        grows its arena and its kernels' buffers on the first run of a shape, which would
        otherwise fall on the first request's time to first token. What it writes is never
        read: a request's prefill writes its own positions, and attention reads no further."""
        n = min(self.prefill_chunk, self.context_length - 1)
        self.forward([0] * n, 0)
        if self.bundle.share_buffer:
            self.decode([0] * self.slots, [1] * self.slots)
        else:  # one step after the chunk, then the growing cache it made is dropped
            self.decode([0], [n + 1])
            self.release(0)

    def _views(self, lo: int, n: int) -> tuple[list, object]:
        """OrtValues over slots lo..lo+n-1 of the cache and of the one-token logits buffer."""
        if (lo, n) not in self._view_cache:
            kv = [ort.OrtValue.ortvalue_from_numpy(a[lo : lo + n]) for a in self.kv_arrays]
            logits = ort.OrtValue.ortvalue_from_numpy(self.logits_array[lo : lo + n])
            self._view_cache[(lo, n)] = (kv, logits)
        return self._view_cache[(lo, n)]

    def _run_shared(
        self, rows: list[list[int]], totals: list[int], lo: int, every: bool = False
    ) -> np.ndarray:
        """Logits [rows, vocab] of each row's last token, or with `every` [rows, seq, vocab]
        of all its tokens; row i is slot lo + i, whose sequence is `totals[i]` long with this
        row's tokens (GroupQueryAttention reads each row's length from its mask and writes the
        new entries at that place)."""
        n, seq = len(rows), len(rows[0])
        kv, logits_buf = self._views(lo, n)
        width = max(totals)
        b = self.binding
        b.bind_cpu_input("input_ids", np.array(rows, np.int64))
        mask = (np.arange(width)[None] < np.array(totals)[:, None]).astype(np.int64)
        b.bind_cpu_input("attention_mask", mask)
        if self.last_only:
            b.bind_ortvalue_input("logits_to_keep", self._all if every else self._last)
        for name, buf in zip(self.past_names, kv):
            b.bind_ortvalue_input(name, buf)
        # Outputs come back in bind order, and a bound output must keep its shape: logits are
        # bound first, to the fixed one-row-per-slot buffer when one position per row comes out.
        b.clear_binding_outputs()
        whole = seq > 1 and (every or not self.last_only)
        if whole:
            b.bind_output("logits")
        else:
            b.bind_ortvalue_output("logits", logits_buf)
        for name, buf in zip(self.present_names, kv):
            b.bind_ortvalue_output(name, buf)
        with hugepages.stepping():
            self.session.run_with_iobinding(b)
        if whole:
            out = b.get_outputs()[0].numpy()
            return out if every else out[:, -1]
        if every:
            return self.logits_array[lo : lo + n].copy()
        # A view of the reused buffer: copied, or the next step would overwrite the caller's.
        return self.logits_array[lo : lo + n, 0].copy()

    def _run_concat(self, ids: list[int], total: int, every: bool = False) -> np.ndarray:
        """As _run_shared for one row, on a growing cache: the run attends to the first
        `total - len(ids)` positions held (as a shared buffer's row is read up to its mask),
        and its present outputs, those and the new ones, are the cache after."""
        past_len = total - len(ids)
        held = next(iter(self._past.values())).shape[2] if self._past else 0
        if past_len > held:
            raise ValueError(f"the cache holds {held} positions; {past_len} were to come before")
        if past_len == 0:
            empty = (1, self.bundle.kv_heads, 0, self.bundle.head_dim)
            self._past = {n: np.zeros(empty, self.kv_dtype) for n in self.past_names}
        elif past_len < held:
            self._past = {
                n: np.ascontiguousarray(v[:, :, :past_len]) for n, v in self._past.items()
            }
        feeds = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            **self._past,
        }
        if self.bundle.position_ids:
            feeds["position_ids"] = np.arange(past_len, total, dtype=np.int64)[None]
        if self.last_only:
            feeds["logits_to_keep"] = ALL if every else LAST
        names = ["logits", *self.present_names]
        with hugepages.stepping():
            logits, *present = self.session.run(names, feeds)
        self._past = dict(zip(self.past_names, present))
        return logits[0] if every else logits[0, -1]

    def forward(
        self, ids: list[int], past_len: int, slot: int = 0, every: bool = False
    ) -> np.ndarray:
        """Logits [vocab] of the last of `ids`, fed after `past_len` cached tokens of `slot`;
        with `every`, logits [len(ids), vocab] of each of them (what scoring a prompt needs)."""
        total = past_len + len(ids)
        if not ids or total > self.context_length:
            raise ValueError(f"{total} tokens do not fit the context of {self.context_length}")
        self._check_slot(slot)
        if not self.bundle.share_buffer:
            return self._run_concat(ids, total, every)
        # A long prompt goes in chunks, each attending to the cache the previous ones wrote:
        # the same logits, but the attention scores and activations of one run stay bounded,
        # and so does the peak memory. PREFILL_CHUNK is where smaller chunks stopped saving
        # memory and began to cost time.
        parts = []
        for lo in range(0, len(ids) - self.prefill_chunk, self.prefill_chunk):
            chunk = list(ids[lo : lo + self.prefill_chunk])
            parts.append(self._run_shared([chunk], [past_len + lo + len(chunk)], slot, every))
        last = list(ids[(len(ids) - 1) // self.prefill_chunk * self.prefill_chunk :])
        parts.append(self._run_shared([last], [total], slot, every))
        return np.concatenate([p[0] for p in parts]) if every else parts[-1][0]

    def decode(self, tokens: list[int], totals: list[int], lo: int = 0) -> np.ndarray:
        """One step of slots lo..lo+n-1 in one run: logits [n, vocab]. `totals[i]` is slot
        lo+i's length with its new token; an idle slot in the range takes a placeholder row,
        which writes one entry at position totals[i]-1 of its own slot."""
        if not 0 < len(tokens) == len(totals) <= self.slots - lo or lo < 0:
            raise ValueError(
                f"{len(tokens)} tokens for {len(totals)} lengths from slot {lo} of {self.slots}"
            )
        if max(totals) > self.context_length or min(totals) < 1:
            raise ValueError(f"lengths {totals} do not fit the context of {self.context_length}")
        if not self.bundle.share_buffer:  # one slot (__init__): its one row, on the growing cache
            return self._run_concat([tokens[0]], totals[0])[None]
        return self._run_shared([[t] for t in tokens], list(totals), lo)

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Yield new token ids until a stop id (not yielded), max_tokens or the context's end.

        The caller may stop iterating at any time (a stop string, a client gone)."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) >= self.context_length:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens; the context holds {self.context_length}"
            )
        rng = np.random.default_rng(params.seed)
        context = np.zeros(self.context_length, np.int64)
        context[: len(prompt)] = prompt
        n = len(prompt)
        logits = self.forward(list(prompt), 0)
        made = 0
        while True:
            token = sample(logits, params, rng, context[:n], context[len(prompt) : n])
            if token in params.stop_token_ids:
                return
            yield token
            context[n] = token
            n += 1
            made += 1
            if made >= params.max_tokens or n >= self.context_length:
                return
            logits = self.forward([token], n - 1)

"""Serve engine: the preallocated-cache loop against the export stage's plain loop, cache reuse
across requests, sampling through the engine, limits; on conftest's `tiny_bundle` (a random 2-layer
Llama exported at fp32 once per session)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from doel.serve.core.engine import BundleError, Engine, read_bundle
from doel.serve.core.sampling import SamplingParams

CONTEXT = 96  # the tiny bundle's (conftest.BUNDLE_CONTEXT)


@pytest.fixture(scope="module")
def engine(tiny_bundle) -> Engine:
    return Engine(read_bundle(tiny_bundle), threads=1)


def _reference(bundle: Path):
    from doel.export.runner import OnnxLM

    b = read_bundle(bundle)
    return OnnxLM(b.model, b.kv_heads, b.head_dim, threads=1)


PROMPT = [0, 398, 841, 405, 679, 485, 420]


def test_greedy_equals_the_export_stages_plain_loop(engine, tiny_bundle):
    want = _reference(tiny_bundle).greedy(PROMPT, 30)[0]
    assert list(engine.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0))) == want


def test_every_step_matches_a_full_forward_and_the_cache_is_never_reallocated(engine, tiny_bundle):
    ids = np.random.default_rng(0).integers(8, 2048, size=40).tolist()
    full = _reference(tiny_bundle).logits(np.array([ids]))[0]
    ptrs = [kv.data_ptr() for kv in engine.kv]
    got = [engine.forward(ids[:10], 0)]
    got += [engine.forward([t], 10 + i) for i, t in enumerate(ids[10:])]
    assert np.abs(np.stack(got) - full[9:]).max() < 1e-5 * np.abs(full).max()
    assert [kv.data_ptr() for kv in engine.kv] == ptrs
    assert all(kv.shape() == [1, 2, CONTEXT, 16] for kv in engine.kv)


def test_a_long_request_leaves_nothing_that_changes_the_next(engine, tiny_bundle):
    sampled = SamplingParams(max_tokens=25, temperature=1.0, seed=7)
    fresh = list(Engine(read_bundle(tiny_bundle), threads=1).generate(PROMPT[:3], sampled))
    long = SamplingParams(max_tokens=80, temperature=1.0, seed=1)
    assert len(list(engine.generate(PROMPT, long))) == 80
    assert list(engine.generate(PROMPT[:3], sampled)) == fresh


def test_seeds_reproduce_and_differ(engine):
    def run(seed):
        return list(engine.generate(PROMPT, SamplingParams(max_tokens=20, seed=seed)))

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert len(set(run(3))) > 5  # sampled, not the greedy loop's one repeated token


def test_stop_ids_end_the_completion_without_being_returned(engine):
    greedy = list(engine.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0)))
    stopped = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(greedy[0],))
    assert list(engine.generate(PROMPT, stopped)) == []


def test_generation_stops_at_the_end_of_the_context(engine):
    made = list(engine.generate(PROMPT, SamplingParams(max_tokens=1000, temperature=0)))
    assert len(made) == CONTEXT - len(PROMPT)
    with pytest.raises(ValueError, match=f"the prompt is {CONTEXT} tokens; the context holds"):
        next(engine.generate([5] * CONTEXT, SamplingParams()))


def test_a_folder_that_is_not_a_bundle_is_refused(tmp_path, tiny_bundle):
    with pytest.raises(BundleError, match="has no manifest.json"):
        read_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(BundleError, match="is not a doel-export manifest"):
        read_bundle(tmp_path)
    b = read_bundle(tiny_bundle)
    assert b.eos_id == 1 and b.context_length == CONTEXT and b.share_buffer


# A manifest as doel-export writes an ONNX bundle's (version 1: before `kind`), fields trimmed.
ONNX_MANIFEST = {
    "format": "doel-export",
    "format_version": 1,
    "model": "model.onnx",
    "kv_cache": {"layers": 2, "kv_heads": 1, "head_dim": 8, "past_present_share_buffer": True},
    "vocab_size": 64,
    "context_length": 32,
    "special_tokens": {"eos": {"id": 1, "text": "<|eos|>"}},
}
# A GGUF folder's, as `doel-export --format gguf` wrote it before format_version (and after).
GGUF_MANIFEST = {
    "format": "doel-export",
    "kind": "gguf",
    "quant": "q8_0",
    "gguf": "model-q8_0.gguf",
}


def _folder(tmp_path: Path, manifest) -> Path:
    """A folder with the bundle's files (empty: read_bundle does not open them) and `manifest`
    (a dict, or the file's text)."""
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes(b"")
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    (tmp_path / "manifest.json").write_text(text, encoding="utf-8")
    return tmp_path


def _without(data: dict, *path: str) -> dict:
    data = json.loads(json.dumps(data))
    *above, last = path
    inner = data
    for key in above:
        inner = inner[key]
    del inner[last]
    return data


def test_the_manifest_read_through_the_contract_gives_the_engine_its_figures(tmp_path):
    b = read_bundle(_folder(tmp_path, ONNX_MANIFEST))
    kv = ONNX_MANIFEST["kv_cache"]
    assert (b.layers, b.kv_heads, b.head_dim) == (kv["layers"], kv["kv_heads"], kv["head_dim"])
    assert (b.vocab_size, b.context_length) == (64, 32) and b.share_buffer and not b.position_ids
    assert b.eos_id == 1 and b.model == tmp_path / "model.onnx"
    assert b.manifest["kv_cache"]["layers"] == kv["layers"]
    assert read_bundle(_folder(tmp_path, {**ONNX_MANIFEST, "format_version": 2, "kind": "onnx"}))


@pytest.mark.parametrize(
    "manifest, said",
    [
        (GGUF_MANIFEST, "holds a GGUF for llama.cpp (model-q8_0.gguf): run it with llama-server"),
        ({**GGUF_MANIFEST, "format_version": 2}, "or export an ONNX bundle with doel-export "),
        ({**ONNX_MANIFEST, "format_version": 99}, "format version 99, newer than this doel"),
        ("{not json", "manifest.json is not JSON"),
        ("[]", "is not a doel-export manifest"),
        ({**ONNX_MANIFEST, "format": "doel-web"}, "is not a doel-export manifest"),
        (_without(ONNX_MANIFEST, "kv_cache"), "needs model, kv_cache and vocab_size"),
        (_without(ONNX_MANIFEST, "model"), "needs model, kv_cache and vocab_size"),
        (_without(ONNX_MANIFEST, "kv_cache", "head_dim"), "is damaged (TypeError"),
        (_without(ONNX_MANIFEST, "context_length"), "has no context_length"),
        ({**ONNX_MANIFEST, "vocab_size": "many"}, "is damaged (ValueError"),
        ({**ONNX_MANIFEST, "kv_cache": [2, 1, 8]}, "is damaged (AttributeError"),
        ({**ONNX_MANIFEST, "special_tokens": ["<|eos|>"]}, "(ValueError"),
    ],
)
def test_a_folder_the_engine_cannot_run_is_a_one_line_error_saying_what_to_do(
    tmp_path, manifest, said
):
    with pytest.raises(BundleError) as caught:
        read_bundle(_folder(tmp_path, manifest))
    message = str(caught.value)
    assert said in message and "\n" not in message, message


def test_a_graph_without_a_shared_cache_gives_the_same_tokens(tiny_bundle, engine, tmp_path):
    """optimum's graphs (other architectures) concatenate their cache; same weights, same ids."""
    from doel.export.bundle import ExportOptions, export_checkpoint

    opts = ExportOptions(quant="fp32", engine="optimum", eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", tmp_path / "optimum", opts)
    other = read_bundle(tmp_path / "optimum")
    assert not other.share_buffer and other.position_ids
    params = SamplingParams(max_tokens=20, seed=2)
    assert list(Engine(other, threads=1).generate(PROMPT, params)) == list(
        engine.generate(PROMPT, params)
    )


def test_slots_prefilled_apart_then_stepped_together_match_full_forwards(tiny_bundle):
    """What continuous batching needs: each slot is prefilled alone (any prompt length), then
    all step in one batched run with ragged lengths; a slot can take a new sequence while the
    others continue."""
    engine, lm = Engine(read_bundle(tiny_bundle), threads=1, slots=3), _reference(tiny_bundle)
    rng = np.random.default_rng(0)
    seqs = [PROMPT[:5], PROMPT + [9, 10], PROMPT[:2]]
    for slot, s in enumerate(seqs):
        engine.forward(s, 0, slot=slot)
    ptrs = [kv.data_ptr() for kv in engine.kv]
    worst = 0.0
    for step in range(12):
        for s in seqs:
            s.append(int(rng.integers(8, 2048)))
        if step == 6:  # slot 2 finishes; a new request takes it, the others go on
            seqs[2] = [0, 77, 78, 79]
            engine.forward(seqs[2][:-1], 0, slot=2)
        got = engine.decode([s[-1] for s in seqs], [len(s) for s in seqs])
        for i, s in enumerate(seqs):
            want = lm.logits(np.array([s]))[0, -1]
            worst = max(worst, float(np.abs(got[i] - want).max() / np.abs(want).max()))
    assert worst < 1e-5
    assert [kv.data_ptr() for kv in engine.kv] == ptrs
    with pytest.raises(ValueError, match="do not fit the context"):
        engine.decode([1, 2], [5, CONTEXT + 1])


def test_session_options_reach_onnx_runtime_and_a_turned_value_cache_is_allocated_so(
    tiny_bundle, engine
):
    """ONNX Runtime's session.gqa_value_layout=BNHS asks for the value cache with the positions
    last (benchmarks/probes/probe_ort_options.py): the engine allocates what the session takes, and
    the tokens stay the same, alone and batched. An unknown value is refused by ONNX Runtime."""
    b = read_bundle(tiny_bundle)
    turned = Engine(b, threads=1, slots=2, session_config={"session.gqa_value_layout": "BNHS"})
    shapes = {a.shape for a in turned.kv_arrays}
    assert shapes == {(2, b.kv_heads, CONTEXT, b.head_dim), (2, b.kv_heads, b.head_dim, CONTEXT)}
    want = list(engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0)))
    assert list(turned.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))) == want
    for slot in (0, 1):
        turned.forward(PROMPT, 0, slot=slot)
    step = turned.decode([want[0]] * 2, [len(PROMPT) + 1] * 2)
    assert step.argmax(-1).tolist() == [want[1]] * 2
    with pytest.raises(Exception, match="gqa_value_layout"):
        Engine(b, threads=1, session_config={"session.gqa_value_layout": "sideways"})


def test_the_prompt_asks_the_graph_for_its_last_logits_only(tiny_bundle, engine):
    """Bundles take logits_to_keep: the prompt's run returns one position's logits into the
    preallocated buffer, and gives what the run returning every position gives."""
    assert engine.last_only
    whole = Engine(read_bundle(tiny_bundle), threads=1)
    whole.last_only = False  # as for a bundle exported before logits_to_keep
    ids = (PROMPT * 6)[:40]
    assert np.abs(whole.forward(ids, 0) - engine.forward(ids, 0)).max() < 1e-6
    params = SamplingParams(max_tokens=20, seed=5)
    assert list(whole.generate(PROMPT, params)) == list(engine.generate(PROMPT, params))


def test_a_prompt_fed_in_chunks_gives_what_one_run_gives(tiny_bundle, engine):
    """Long prompts go in chunks (bounded memory); each chunk attends to the ones before."""
    chunked = Engine(read_bundle(tiny_bundle), threads=1, slots=2)
    chunked.prefill_chunk = 4
    ids = np.random.default_rng(3).integers(8, 2048, size=31).tolist()
    want = engine.forward(ids, 0)
    for n in (3, 4, 5, 8, 31):  # under, at, just over and at twice the chunk; many chunks
        got = chunked.forward(ids[:n], 0, slot=1)
        ref = engine.forward(ids[:n], 0)
        assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    params = SamplingParams(max_tokens=12, seed=4)
    assert list(chunked.generate(ids, params)) == list(engine.generate(ids, params))


def test_the_warm_up_at_load_changes_no_request(tiny_bundle):
    """warm_up runs a prefill chunk and a step of every slot once (ONNX Runtime's first runs of
    a shape pay for its buffers); what it leaves in the cache is never read by a request."""
    cold = Engine(read_bundle(tiny_bundle), threads=1, slots=2)
    warm = Engine(read_bundle(tiny_bundle), threads=1, slots=2)
    ptrs = [kv.data_ptr() for kv in warm.kv]
    runs = []
    run = warm.session.run_with_iobinding
    warm.session.run_with_iobinding = lambda b: runs.append(1) or run(b)
    warm.warm_up()
    assert len(runs) == 2 and [kv.data_ptr() for kv in warm.kv] == ptrs
    assert np.abs(warm.kv_arrays[0][:, :, 0]).max() > 0  # it did write
    for params in (
        SamplingParams(max_tokens=15, temperature=0),
        SamplingParams(max_tokens=15, seed=3),
    ):
        assert list(warm.generate(PROMPT[:3], params)) == list(cold.generate(PROMPT[:3], params))
    for slot in (0, 1):
        got, want = warm.forward(PROMPT[:2], 0, slot=slot), cold.forward(PROMPT[:2], 0, slot=slot)
        assert np.array_equal(got, want)
    assert np.array_equal(warm.decode([5, 6], [3, 3]), cold.decode([5, 6], [3, 3]))


def test_the_service_warms_its_engine_up_when_it_loads(tiny_bundle, monkeypatch):
    from doel.serve.core.service import Service

    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self.slots))
    Service.load(str(tiny_bundle), threads=1, slots=3)
    assert calls == [3]


@pytest.mark.parametrize(
    "kv_cache, dtype", [("fp32", np.float32), ("fp16", np.float16), ("int8", np.int8)]
)
def test_a_quantized_bundle_decodes_as_its_plain_loop(tiny_bundle, tmp_path, kv_cache, dtype):
    """An int4 bundle with each cache precision (fp16, int8: export/kvcache.py): the engine
    allocates the cache so, in every slot, and gives the export stage's greedy tokens, alone and
    batched."""
    from doel.export.bundle import ExportOptions, export_checkpoint

    opts = ExportOptions(quant="int4", kv_cache=kv_cache, eval_tokens=64, log=lambda _m: None)
    export_checkpoint(tiny_bundle.parent / "serve-ckpt", tmp_path / "int4", opts)
    b = read_bundle(tmp_path / "int4")
    assert b.manifest["kv_cache"]["dtype"] == np.dtype(dtype).name
    engine = Engine(b, threads=1, slots=2)
    assert engine.kv_dtype == dtype and all(a.dtype == dtype for a in engine.kv_arrays)
    engine.warm_up()
    want = _reference(tmp_path / "int4").greedy(PROMPT, 20)[0]
    assert list(engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0))) == want
    first = [engine.forward(PROMPT, 0, slot=s).argmax() for s in (0, 1)]
    assert first == [want[0]] * 2
    assert engine.decode([want[0]] * 2, [len(PROMPT) + 1] * 2).argmax(-1).tolist() == [want[1]] * 2

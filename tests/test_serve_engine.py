"""Serve engine: the preallocated-cache loop against the export stage's plain loop, cache reuse
across requests, sampling through the engine, limits; on conftest's `tiny_bundle` (a random 2-layer
Llama exported at fp32 once per session)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from doel.serve.engine import BundleError, Engine, read_bundle
from doel.serve.sampling import SamplingParams

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
    last (benchmarks/probe_ort_options.py): the engine allocates what the session takes, and the
    tokens stay the same, alone and batched. An unknown value is refused by ONNX Runtime."""
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
    from doel.serve.service import Service

    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self.slots))
    Service.load(str(tiny_bundle), threads=1, slots=3)
    assert calls == [3]


@pytest.mark.parametrize("kv_cache, dtype", [("fp32", np.float32), ("fp16", np.float16)])
def test_a_quantized_bundle_decodes_as_its_plain_loop(tiny_bundle, tmp_path, kv_cache, dtype):
    """An int4 bundle with either cache precision (fp16: export/kvcache.py): the engine allocates
    the cache so, in every slot, and gives the export stage's greedy tokens, alone and batched."""
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

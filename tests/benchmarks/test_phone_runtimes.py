"""The phone runtimes' row modules (benchmarks/runtimes/executorch_*.py, litertlm_*.py): how
their reports read, on made-up probe answers. The probes themselves run ExecuTorch and LiteRT-LM
(tests/export/test_pte.py, test_litertlm.py, slow) and the rows are in
benchmarks/results/runtimes.md."""

from __future__ import annotations

import json

from benchmarks.checks.check_arm64 import _site
from benchmarks.runtimes.executorch_arm64 import flatten, spec
from benchmarks.runtimes.executorch_smollm2 import departure_row, with_stop


def test_a_reply_that_ended_early_is_held_to_its_stop_too():
    assert with_stop([[5, 6], [7] * 4], [2, 9], 4) == [[5, 6, 2], [7] * 4]


def test_departures_are_reported_with_each_first_step_and_margin():
    found = [None, {"step": 6, "margin": 0.7785}, {"step": 0, "margin": 2.5}]
    r = departure_row("1.5.1", "greedy ids vs X", found, "int4 against fp32")
    assert r["ok"] and r["check"] == "greedy ids vs X (reported: int4 against fp32)"
    assert r["result"] == "2 of 3 depart (prompt: first step, margin: 1: step 6 margin 0.778, " \
        "2: step 0 margin 2.5)"  # fmt: skip
    assert departure_row("1.5.1", "w", [None], "why")["result"] == "0 of 1 depart"


def test_the_arm64_probe_runs_every_program_in_one_process_held_to_x86s_ids(tmp_path):
    ptes = {q: tmp_path / q for q in ("fp32", "int4", "int8")}
    for folder in ptes.values():
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps({"executorch": {"add_bos": 1}}))
    prompts = {"fp32": [[1, 2]], "int4": [[1, 2]], "int8": [[1, 2]], "smol": [[3]], "stops": [2]}
    x86 = spec(ptes, tmp_path / "smol", prompts, ["a", "b"], None)
    assert x86["texts"] == ["a", "b"] and x86["bos"] == 1 and x86["want"] == [[]]
    names = [a["pte"].rsplit("/", 1)[1] for a in x86["also"]]
    assert names == ["model-int4.pte", "model-int8.pte", "model-int4.pte"]
    assert x86["also"][2]["stops"] == [2] and x86["also"][2]["texts"] == ["a", "b"]
    want = {"fp32": [[4]], "int4": [[5]], "int8": [[6]], "smol": [[7]]}
    arm = spec(ptes, tmp_path / "smol", prompts, None, want)
    assert arm["texts"] == [] and arm["want"] == [[4]] and arm["also"][2]["want"] == [[7]]
    got = {"gen": 1, "also": [{"gen": 2}, {"gen": 3}, {"gen": 4}]}
    assert {k: v["gen"] for k, v in flatten(got).items()} == {
        "fp32": 1,
        "int4": 2,
        "int8": 3,
        "smol": 4,
    }


def test_an_aarch64_site_folder_is_named_by_its_pins_and_hashed_past_a_few():
    assert _site(["litert-lm-api==0.18.1"]) == "site-litert-lm-api0.18.1"
    many = [f"package{i}==1.{i}" for i in range(20)]
    assert _site(many).startswith("site-package01.0-") and len(_site(many)) < 40
    assert _site(many) == _site(list(many)) != _site(many[:-1])


def test_a_probe_stopped_by_qemu_is_said_in_qemus_words():
    from benchmarks.runtimes.executorch_arm64 import failure

    e = RuntimeError("LiteRT-LM's probe failed: ['\x00qemu: uncaught target signal 4 (Illegal x)']")
    assert failure(e) == "qemu: uncaught target signal 4 (Illegal x)"
    assert failure(RuntimeError("no such file")) == "no such file"

"""The real-model benchmark's logic on made-up numbers: where a greedy reply departs, which
bound the export refuses and whether the bound or the format is blamed, and the report."""

from __future__ import annotations

import json

from benchmarks.export import bench_real_model as bench
from benchmarks.export import bench_real_model_report as report


def test_departure_is_the_first_differing_token_or_where_one_reply_stops_first():
    assert bench.departure([1, 2, 3], [1, 2, 3]) is None
    assert bench.departure([1, 2, 3], [1, 5, 3]) == 1
    assert bench.departure([1, 2, 3], [1, 2]) == 2  # stopped one token early
    assert bench.departure([1, 2], [1, 2, 9]) == 2  # ran past the reference's stop
    assert bench.departure([], []) is None


def _row(name: str, increase: float) -> dict:
    return {"variant": name, "increase_nats_per_token": increase}


def _bundle(tmp_path, name: str, increase: float):
    folder = tmp_path / name.replace(" ", "-").replace(",", "")
    folder.mkdir()
    loss = {"increase_nats_per_token": increase, "tokens": 4095, "files": [{"text": "bn.txt"}]}
    (folder / "manifest.json").write_text(json.dumps({"parity": {"loss": loss}}))
    return folder


def test_bounds_blame_the_bound_where_llama_cpp_is_past_it_too_and_the_format_where_not(
    tmp_path,
):
    rows = [
        _row("torch fp32", 0.0),
        _row("doel fp32", 0.0),
        _row("doel int8 b64", 0.004),
        _row("doel int4 b64, head int8", 0.16),
        _row("doel int4 b32, head int8", 0.12),
        _row("llama.cpp q8_0", 0.003),
        _row("llama.cpp q4_0", 0.14),
    ]
    bundles = {
        "doel fp32": _bundle(tmp_path, "doel fp32", 0.0),  # no loss bound: not listed
        "doel int8 b64": _bundle(tmp_path, "doel int8 b64", 0.006),
        "doel int4 b64, head int8": _bundle(tmp_path, "doel int4 b64, head int8", 0.19),
        "doel int4 b32, head int8": _bundle(tmp_path, "doel int4 b32, head int8", 0.13),
    }
    got = {b["variant"]: b for b in bench.bound_rows(rows, bundles)}
    assert list(got) == ["doel int8 b64", "doel int4 b32, head int8", "doel int4 b64, head int8"]
    int8 = got["doel int8 b64"]
    assert int8["bound_nats_per_token"] == 0.02 and not int8["refused_by_export"]
    assert int8["peer"] == "llama.cpp q8_0" and int8["peer_increase_here"] == 0.003
    assert "passes it" in report.verdict(int8)
    int4 = got["doel int4 b64, head int8"]
    assert int4["refused_by_export"] and int4["past_bound_here"] and int4["peer_past_bound"]
    assert int4["export_check"] == {"increase_nats_per_token": 0.19, "tokens": 4095,
                                    "texts": ["bn.txt"]}  # fmt: skip
    assert "the bound is wrong for this model." in report.verdict(int4)
    assert report.verdict(int4).endswith("costs 1.14× llama.cpp q4_0's increase.")  # 0.16 / 0.14
    # the same refusal where llama.cpp's format of the same bits stays within the bound
    rows[-1] = _row("llama.cpp q4_0", 0.05)
    int4 = {b["variant"]: b for b in bench.bound_rows(rows, bundles)}["doel int4 b64, head int8"]
    assert not int4["peer_past_bound"] and "the format is wrong." in report.verdict(int4)


def _loss_row(name: str, en: float, bn: float) -> dict:
    def lang(text: str, inc: float) -> dict:
        return {"text": text, "nats_per_token": 3 + inc, "bits_per_char": 2 + inc,
                "increase_nats_per_token": inc,
                "increase_bits_per_char": inc / 2}  # fmt: skip

    return {
        "variant": name,
        "weights": None,
        "files": [lang("en", en), lang("bn", bn)],
        "increase_nats_per_token": (en + bn) / 2,
        "increase_nats_per_token_se": 0.001,
    }


def _speed_row(name: str, tok_s: float, busy: bool) -> dict:
    short = {"decode_tok_s": tok_s, "ttft_s": 0.2, "bangla_chars_s": tok_s / 2}
    long = {"decode_tok_s": tok_s / 2, "ttft_s": 0.2, "bangla_chars_s": tok_s / 4}
    return {"row": name, "short": short, "long": long, "peak_rss_mb": 300.0,
            "foreign_cpu_s": 9.0, "busy": busy}  # fmt: skip


def test_the_report_has_every_section_and_marks_busy_rows():
    greedy = {
        "chats": ["Hi?", "কী?"],
        "new_tokens": 8,
        "reference": {"replies": [[1, 2, 3], [4, 5]], "texts": ["A | b", "গ" * 60]},
        "formats": {
            "doel int8 b64": {"departures": [None, 1], "identical": 1},
            "llama.cpp q8_0": {
                "departures": [2, None],
                "identical": 1,
                "same_prompt": [True, True],
                "same_as_chat_endpoint": [True, False],
            },  # fmt: skip
        },
    }
    none = {"type": "", "bytes": 0, "weights": 0, "bits_per_weight": None}
    fp32_bundle = _loss_row("doel fp32", 0, 0) | {"weights": {"linear": none, "head": none}}
    res = {
        "date": "2026-12-06",
        "machine": "x86_64, 2 cores",
        "cpu": {"model_name": "AMD EPYC", "class": "amd-avx2", "isa": {"AVX2": True}},
        "model": "SmolLM2",
        "commit": "abc1234",
        "load_start": 1.0,
        "load_end": "load average 1.2 at the end",
        "texts": [{"name": "en", "files": [{"path": "en/a.txt"}], "chars": 100}],
        "window": 512,
        "threads": 2,
        "loss": {
            "rows": [
                _loss_row("torch fp32", 0, 0),
                fp32_bundle,  # no MatMulNBits: its linear layers' bits are None
                _loss_row("doel int8 b64", 0.004, 0.006),
            ],
            "f32_check": {"max_rel_diff": 1e-5, "tolerance": 1e-3, "passed": True},
        },
        "bounds": [],
        "export_refused_even_lifted": {"doel int4 b32, head int4": "parity check failed: kv"},
        "greedy": greedy,
        "bangla_chars_per_token": 0.5,
        "export_default_blocks": {"int8": 64, "int4": 64},
        "speed": {
            "settings": bench.SPEED | {"processes": 2},
            "targets": [
                {
                    "target": "decode int8 / q8_0",
                    "value": 1.11,
                    "op": ">=",
                    "threshold": 1.1,
                    "met": True,
                },
                {
                    "target": "peak memory int4 / q4_0",
                    "value": None,
                    "op": "<=",
                    "threshold": 1.1,
                    "met": None,
                },
            ],  # fmt: skip
            "rows": [
                _speed_row("doel int8 (b64)", 100.0, False),
                _speed_row("llama.cpp q8_0", 90.0, True),
            ],  # fmt: skip
        },
    }
    md = bench.markdown(res)
    for part in ("held-out loss", "export's own bound", "Greedy agreement", "one stream"):
        assert part in md
    assert "| doel int8 b64 | 32 fp32 | 32 fp32 | 3.0040 (2.004) | +0.0040 | +0.0020 |" in md
    assert "| doel fp32 | 32 fp32 | 32 fp32 | 3.0000 (2.000) | +0.0000 |" in md
    assert "| Hi? | A / b (3) | — | 2 |" in md  # a reply's "|" kept out of the table
    assert f"| কী? | {'গ' * 48}… (2) | 1 | — |" in md
    assert "| decode int8 / q8_0 (>= 1.1) | 1.11 | True |" in md
    assert (
        "| peak memory int4 / q4_0 (<= 1.1) | not measured | |" in md
        and "| **identical replies** | | 1/2 | 1/2 |" in md
    )
    assert "llama.cpp q8_0 2/2 and 1/2" in md  # its rendering, its chat endpoint
    assert "| llama.cpp q8_0 | 90.0 / 45.0 | 45.0 / 22.5 |" in md and "9 (busy) |" in md
    assert "576 and 1,536): int8 64, int4 64; the head at 8 bits." in md
    assert "not written even with the bound lifted: parity check failed: kv" in md

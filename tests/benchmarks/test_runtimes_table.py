"""bench_runtimes --only: the modules not rerun keep their rows from the table already written,
each marked with the run that made it; the rerun modules' old rows are replaced."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.runtimes.bench_runtimes import kept_rows, markdown

ROOT = Path(__file__).resolve().parents[2]
ROW = {"check": "c", "result": "r"}


def test_rows_of_modules_not_rerun_are_kept_with_their_run(tmp_path):
    earlier = {
        "date": "2026-12-04",
        "cpu": {"class": "intel-avx512-vnni"},
        "rows": [
            {
                "module": "genai",
                "runtime": "g",
                "version": "1",
                "check": "c",
                "result": "r",
                "ok": 1,
            },
            {
                "module": "ollama",
                "runtime": "o",
                "version": "2",
                "check": "c",
                "result": "r",
                "ok": 0,
            },
        ],
    }
    (tmp_path / "runtimes.json").write_text(json.dumps(earlier), encoding="utf-8")
    kept = kept_rows(tmp_path, ["genai"])
    assert [r["module"] for r in kept] == ["ollama"]
    assert kept[0]["run"] == "2026-12-04, intel-avx512-vnni"
    assert kept_rows(tmp_path / "none", ["genai"]) == []
    new = {"module": "genai", "runtime": "g", "version": "3", "check": "c", "result": "r", "ok": 1}
    cpu = json.loads((ROOT / "benchmarks/results/runtimes.json").read_text("utf-8"))["cpu"]
    result = {"date": "2026-12-06", "machine": "x", "cpu": cpu, "rows": [new, *kept], "load": "l"}
    text = markdown(result)
    assert "`ollama` (run 2026-12-04, intel-avx512-vnni)" in text and "| **no** |" in text
    assert "| g | 3 |" in text and "| g | 1 |" not in text

"""probe_demo_load's fair-share bound (issue 38, point 1): read from the thread measure's own
line (train/threads.py writes it, so a change of its wording is caught here), and the bound the
report computes from a result."""

from __future__ import annotations

from benchmarks.probes.probe_demo_load import fair_share, report, step_seconds
from doel.train.threads import ThreadChooser


def test_the_fair_share_bound_comes_from_the_quiet_one_thread_step_time():
    lines: list[str] = []
    chooser = ThreadChooser([2, 1], log=lines.append, set_threads=lambda n: None)
    chooser.times = {2: [0.091], 1: [0.150]}
    chooser._choose()
    assert step_seconds(lines) == {2: 0.091, 1: 0.150}
    case = {"load_before": 1.0, "steps": 400, "tokens_per_s": 2446, "all_steps_s": 167.0}
    result = {
        "date": "2026-12-03",
        "machine": "x86_64, 2 cores, Python 3.11.7",
        "cpu": {"class": "x", "model_name": "y", "isa": {}},
        "neighbours": 4,
        "budget": 30.0,
        "default_threads": 2,
        "cases": [
            case | {"case": name, "neighbours": n, "threads": 2, "choices": choices}
            for name, n, choices in [
                ("old-quiet", 0, []),
                ("new-quiet", 0, lines),
                ("old-neighbour", 4, []),
                ("new-neighbour", 4, []),
            ]
        ],
    }
    bound = fair_share(result)
    assert bound["share"] == 0.4  # 2 cores among 5 spinning threads
    assert round(bound["tok_s"]) == round(1024 / 0.150 * 0.4)
    assert round(bound["all_steps_s"]) == 150
    assert "all 400 steps in 150 s; the new policy reached 90% of it" in report(result)
    result["cases"][1]["choices"] = []  # no measure: no bound, no line
    assert fair_share(result) is None and "Fair-share" not in report(result)

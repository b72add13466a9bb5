"""tools/flower_overhead.py's arithmetic: per-round seconds both ways, the steady overhead, and
the figures compared but the times (the runs themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "flower_overhead", Path(__file__).resolve().parent.parent / "tools" / "flower_overhead.py"
)
overhead = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(overhead)


def _record(r: int, train: float, ev: float | None, **extra: object) -> dict:
    return {"round": r, "train_seconds": train, "eval_seconds": ev, "accuracy": 0.5 + r,
            **extra}  # fmt: skip


def test_the_overhead_per_round_and_its_steady_median() -> None:
    sim = [_record(1, 10.0, 2.0), _record(2, 3.0, 1.0), _record(3, 3.0, None), _record(4, 2.0, 1.0)]
    fl = [_record(1, 20.0, 5.0), _record(2, 6.0, 2.5), _record(3, 5.0, None), _record(4, 9.0, 1.0)]
    got = overhead.compare(sim, fl)
    assert [r["overhead_s"] for r in got["rounds"]] == [13.0, 4.5, 2.0, 7.0]
    assert got["first_round_overhead_s"] == 13.0
    assert got["steady_overhead_s"] == 4.5  # the median of 4.5, 2.0, 7.0
    table = overhead.markdown({**got, "simulation_wall_s": 30.0, "flower_wall_s": 70.0})
    assert "| 2 | 3.00 / 1.00 | 6.00 / 2.50 | +4.50 |" in table
    assert "| 3 | 3.00 / 0.00 | 5.00 / 0.00 | +2.00 |" in table
    assert "+4.50 s a round" in table
    assert "Load average" not in table  # none measured
    loads = {"simulation start": (1.24, 2.0, 3.06), "end": (0.5, 0.31, 0.74)}
    table = overhead.markdown({**got, "simulation_wall_s": 30.0, "flower_wall_s": 70.0,
                               "load_averages": loads})  # fmt: skip
    assert table.endswith(
        "Load average (1 / 5 / 15 min): simulation start 1.2 / 2.0 / 3.1; end 0.5 / 0.3 / 0.7.\n"
    )


def test_the_figures_are_compared_but_times_and_flower_only_keys() -> None:
    sim = [_record(1, 1.0, 1.0)]
    assert overhead._same_figures(sim, [_record(1, 9.0, 3.0, clients_failed=[])])
    assert not overhead._same_figures(sim, [{**_record(1, 1.0, 1.0), "accuracy": 0.25}])
    with pytest.raises(ValueError):  # a round missing on one side
        overhead.compare(sim, sim + sim)

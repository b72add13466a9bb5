"""tools/fedopt_tuning.py: the grid it runs (Reddi et al.'s decades, cut to a band of eta / tau),
the check runs at the registry's defaults (no server flags), and its tables from run directories
made by hand."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fedopt_tuning", Path(__file__).resolve().parents[1] / "tools" / "fedopt_tuning.py"
)
tuning = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tuning)


def _run(root: Path, name: str, accuracy: float, config: dict | None = None) -> None:
    d = root / name
    d.mkdir(parents=True)
    records = [{"round": 1, "accuracy": None, "train_loss": 0.7},
               {"round": 2, "accuracy": accuracy, "train_loss": 0.5}]  # fmt: skip
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    (d / "summary.json").write_text(json.dumps({"seconds": 60.0}))
    (d / "config.json").write_text(json.dumps(config or {}))
    (root / f"{name}.log").write_text("commit abc1234\ncmd\n")


def test_the_grid_is_in_reddi_et_als_decades_and_the_band() -> None:
    full = [item for algs in tuning.FULL.values() for item in algs.items()]
    assert set(tuning.FULL) <= set(tuning.PRESETS)
    for alg, cells in [*tuning.GRID.items(), *full]:
        assert alg in tuning.ADAPTIVE and cells and len(set(cells)) == len(cells)
        for eta, tau in cells:
            assert 1e-3 <= eta <= 10 and 1e-5 <= tau <= 1e-1
            assert 0.1 - 1e-12 <= eta / tau <= 100 + 1e-9
    planned = dict(tuning.grid_runs())
    args = planned["tune_fedadam_lr1e-2_tau1e-3"]
    assert "--server-lr=0.01" in args and "--server-tau=0.001" in args
    assert "--algorithm=fedadam" in args and "--critical-layer=L" in args
    assert "--server-lr" not in " ".join(planned["tune_fedavg"])


def test_the_checks_run_the_registry_defaults_fedadam_and_fedavg_first() -> None:
    planned = tuning.check_runs([0, 1])
    assert [n for n, _ in planned[:4]] == ["k10_fedadam_s0", "k10_fedavg_s0", "k3_fedadam_s0",
                                           "k3_fedavg_s0"]  # fmt: skip
    assert len(planned) == 2 * len(tuning.PRESETS) * len(tuning.CHECKS)
    for _, args in planned:
        assert not any(a.startswith(("--server-lr", "--server-tau")) for a in args)
    assert "--seed=1" in dict(planned)["k3_fedyogi_s1"]


def test_the_grid_table_marks_cells_outside_it_and_names_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "RUNS", tuning.Runs(tmp_path))
    monkeypatch.setitem(tuning.GRID, "fedadam", [(1e-3, 1e-3), (1e-2, 1e-3), (1e-3, 1e-2)])
    _run(tmp_path, "tune_fedadam_lr1e-3_tau1e-3", 0.61)
    _run(tmp_path, "tune_fedadam_lr1e-2_tau1e-3", 0.78)
    lines, scores = tuning._grid_table("fedadam")
    assert lines[0] == "| eta \\ tau | 1e-3 | 1e-2 |"
    assert lines[2] == "| 1e-3 | 0.610 (0.500) | - |"  # in the grid, not run yet
    assert lines[3] == "| 1e-2 | 0.780 (0.500) | not in the grid |"
    assert scores == {(1e-3, 1e-3): 0.61, (1e-2, 1e-3): 0.78}
    assert "best cell on this preset: eta 0.01, tau 0.001 (0.780)" in tuning._defaults_line(
        "fedadam", scores)  # fmt: skip


def test_the_check_table_says_each_algorithms_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "RUNS", tuning.Runs(tmp_path))
    adam = tuning.ALGORITHMS["fedadam"]
    _run(tmp_path, "k10_fedadam_s0", 0.80)  # saved before config.json had the server settings
    ran = {"server_lr": adam.server_lr, "server_tau": adam.tau}
    _run(tmp_path, "k10_fedadam_s1", 0.76, {"server_settings": ran})
    stale = {"server_lr": adam.server_lr * 3, "server_tau": adam.tau}  # an older default
    _run(tmp_path, "k10_fedadam_s2", 0.50, {"server_settings": stale})
    rows = {line.split(" (")[0].lstrip("| "): line for line in tuning._check_table("k10")[2:]}
    assert f"(eta {adam.server_lr:g}, tau {adam.tau:g}) | 0.780 ± 0.028 (n=2)" in rows["FedAdam"]
    assert "s0: 0.800, s1: 0.760 |" in rows["FedAdam"]
    assert rows["FedAvg"].endswith("| - | - |  |") and "(eta 1)" in rows["FedAvg"]
    # no check run of FedYogi: its full-preset cell at the defaults stands for seed 0
    yogi = tuning.ALGORITHMS["fedyogi"]
    monkeypatch.setitem(tuning.FULL, "k10", {"fedyogi": [(yogi.server_lr, yogi.tau), (1.0, 0.1)]})
    _run(tmp_path, tuning.full_name("k10", "fedyogi", 1.0, 0.1), 0.3)
    rows = {line.split(" (")[0].lstrip("| "): line for line in tuning._check_table("k10")[2:]}
    assert rows["FedYogi"].endswith("| - | - |  |")  # the default cell has not run
    cell = tuning.full_name("k10", "fedyogi", yogi.server_lr, yogi.tau)
    _run(tmp_path, cell, 0.77)
    rows = {line.split(" (")[0].lstrip("| "): line for line in tuning._check_table("k10")[2:]}
    assert rows["FedYogi"].endswith(f"| 0.770 (n=1) | s0: 0.770 | `{cell}` |")
    assert tuning.main(["--presets", "k5", "--report-only"]) == 2


def test_the_full_presets_cells_are_named_by_their_half_decades(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tuning.exponent(10**-1.5) == "1e-1.5" and tuning.exponent(1e-3) == "1e-3"
    planned = dict(tuning.full_runs())
    args = planned["k10grid_fedadam_lr1e-1.5_tau1e-3"]
    assert "--server-lr=0.0316228" in args
    assert "--config=configs/study_rotten_tomatoes.py:k10" in args
    monkeypatch.setattr(tuning, "RUNS", tuning.Runs(tmp_path))
    _run(tmp_path, "k10grid_fedadam_lr1e-1_tau1e-3", 0.77)
    rows = tuning._full_table()
    assert "| FedAdam | 0.1 | 0.001 | 0.770 | 0.770 | 0.500 |" in rows[2]
    assert rows[3].startswith("| FedAdam | 0.0316 | 0.001 | - | - | - |")
    adam = tuning.ALGORITHMS["fedadam"]  # each algorithm's default is one of its cells, named so
    assert sum("(the default)" in r for r in rows) == len(tuning.FULL["k10"])
    named = f"| FedAdam (the default) | {adam.server_lr:.3g} | {adam.tau:g} |"
    assert any(named in r for r in rows)
    k3 = dict(tuning.full_runs())["k3grid_fedyogi_lr1e-2_tau1e-3"]  # a second preset's cells
    assert "--config=configs/study_rotten_tomatoes.py:k3" in k3 and "--server-lr=0.01" in k3
    assert tuning._full_table("k3")[2].startswith("| FedYogi")


def test_a_check_run_at_an_older_default_is_set_aside_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "RUNS", tuning.Runs(tmp_path))
    yogi = tuning.ALGORITHMS["fedyogi"]
    _run(tmp_path, "k3_fedyogi_s0", 0.75, {"server_settings": {"server_lr": 10**-1.5,
                                                               "server_tau": yogi.tau}})
    _run(tmp_path, "k3_fedyogi_s1", 0.78, {"server_settings": {"server_lr": yogi.server_lr,
                                                               "server_tau": yogi.tau}})
    tuning.set_aside_if_stale("k3_fedyogi_s0", "fedyogi")
    tuning.set_aside_if_stale("k3_fedyogi_s1", "fedyogi")  # at the defaults: kept
    assert not (tmp_path / "k3_fedyogi_s0").exists()
    assert (tmp_path / "k3_fedyogi_s0_at_lr1e-1.5" / "summary.json").is_file()
    assert (tmp_path / "k3_fedyogi_s0_at_lr1e-1.5.log").is_file()
    assert (tmp_path / "k3_fedyogi_s1" / "summary.json").is_file()
    # a second stale run at the same lr (its log lost) goes beside the first, not over it
    _run(tmp_path, "k3_fedyogi_s0", 0.74, {"server_settings": {"server_lr": 10**-1.5,
                                                               "server_tau": yogi.tau}})
    (tmp_path / "k3_fedyogi_s0.log").unlink()
    tuning.set_aside_if_stale("k3_fedyogi_s0", "fedyogi")
    assert (tmp_path / "k3_fedyogi_s0_at_lr1e-1.5_2" / "summary.json").is_file()
    assert (tmp_path / "k3_fedyogi_s0_at_lr1e-1.5.log").is_file()  # the first one's, kept
    assert not (tmp_path / "k3_fedyogi_s0").exists()

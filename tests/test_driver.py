"""run.driver: the one run loop, with a counting Run of plain numbers, so that its rules are checked
apart from any model: files written, checkpoint cadence, resume to the same records, the checks
before anything is written, Ctrl-C and the stop hook."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.run import driver, outputs
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir


class Counter:
    """A run whose state is one array; round r adds r to it and records the sum."""

    def __init__(
        self, run_dir: Path, rounds: int = 4, model: str = "m1", labels: str = "LABEL_0"
    ) -> None:
        self.run_dir = run_dir
        self.rounds = rounds
        self.metric = "total"
        self.model = model
        self.labels = labels
        self.total = np.zeros((), np.float32)
        self.calls: list[str] = []
        self.kept: list[list[int]] = []

    def arrays(self) -> dict[str, Any]:
        return {"total": self.total}

    def meta(self) -> dict[str, Any]:
        return {"model_config": {"name": self.model, "id2label": {"0": self.labels},
                                 "label2id": {self.labels: 0}}, "seed": 0}  # fmt: skip

    def resume(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self.calls.append(f"resume {int(meta['round'])}")
        self.total = np.asarray(arrays["total"])

    def start(self, start_round: int, note: Callable[[str], None]) -> None:
        self.calls.append(f"start {start_round}")
        (self.run_dir / "own.json").write_text("{}")
        note(f"starting after round {start_round}")

    def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        assert [h["round"] for h in history] == list(range(1, r))
        self.total = self.total + np.float32(r)
        self.calls.append(f"step {r}")
        return {"round": r, "total": float(self.total), "cum_bytes": 0, "seconds": 0.0}

    def checkpointed(self, r: int, kept: Sequence[int]) -> None:
        self.kept.append(list(kept))

    def summary(self, history: Sequence[dict[str, Any]], stats: driver.Stats) -> dict[str, Any]:
        return {"rounds": len(history), "total": float(self.total),
                "checkpoint_seconds": stats.checkpoint_seconds}  # fmt: skip


def _drive(run: Counter, resume: bool = False, every: int = 2, hook: Any = None) -> dict:
    return driver.drive(run, {"setting": 1}, resume=resume, checkpoint_every=every,
                        progress=False, on_round_end=hook)  # fmt: skip


def test_a_run_writes_its_files_records_and_checkpoints_on_cadence(tmp_path: Path) -> None:
    run = Counter(tmp_path / "run", rounds=5)
    summary = _drive(run, every=2)
    assert summary["rounds"] == 5 and summary["total"] == 15.0
    assert summary["checkpoint_seconds"] > 0
    assert run.calls == ["start 0", "step 1", "step 2", "step 3", "step 4", "step 5"]
    records = outputs.read_jsonl(run.run_dir / "metrics.jsonl")
    assert [r["total"] for r in records] == [1.0, 3.0, 6.0, 10.0, 15.0]
    assert json.loads((run.run_dir / "config.json").read_text()) == {"setting": 1}
    assert json.loads((run.run_dir / "summary.json").read_text())["total"] == 15.0
    assert (run.run_dir / "own.json").is_file()
    # rounds 2, 4 and the last; the last two kept, and the run was told after each save
    assert RunCheckpointer(checkpoint_dir(run.run_dir)).all_rounds() == [4, 5]
    assert run.kept == [[2], [2, 4], [4, 5]]


def test_keep_checkpoints_keeps_only_the_latest_and_says_so(tmp_path: Path) -> None:
    run = Counter(tmp_path / "run", rounds=5)
    driver.drive(run, {"setting": 1}, resume=False, checkpoint_every=2, keep_checkpoints=1,
                 progress=False)  # fmt: skip
    assert RunCheckpointer(checkpoint_dir(run.run_dir)).all_rounds() == [5]
    assert run.kept == [[2], [4], [5]]  # the run may drop what older checkpoints needed
    again = Counter(run.run_dir, rounds=6)
    driver.drive(again, {"setting": 1}, resume=True, checkpoint_every=2, keep_checkpoints=1,
                 progress=False)  # fmt: skip
    assert again.calls[0] == "resume 5" and again.total == 21.0


def test_resume_continues_from_the_checkpoint_to_the_same_records(tmp_path: Path) -> None:
    straight = Counter(tmp_path / "straight", rounds=5)
    _drive(straight, every=1)

    def stop_after_3(r: int, record: dict) -> None:
        if r == 3:
            raise KeyboardInterrupt

    broken = Counter(tmp_path / "broken", rounds=5)
    with pytest.raises(KeyboardInterrupt):
        _drive(broken, every=2, hook=stop_after_3)
    assert not (broken.run_dir / "summary.json").exists()
    # three records on disk, the checkpoint at round 2: resuming truncates to it and redoes 3
    assert len(outputs.read_jsonl(broken.run_dir / "metrics.jsonl")) == 3
    again = Counter(broken.run_dir, rounds=5)
    summary = _drive(again, resume=True, every=2)
    assert again.calls == ["resume 2", "start 2", "step 3", "step 4", "step 5"]
    assert summary["total"] == 15.0
    assert outputs.read_jsonl(again.run_dir / "metrics.jsonl") == outputs.read_jsonl(
        straight.run_dir / "metrics.jsonl"
    )


def test_resume_refuses_another_model_and_a_run_without_a_checkpoint(tmp_path: Path) -> None:
    run = Counter(tmp_path / "run", rounds=2)
    _drive(run, every=1)
    before = sorted(p.name for p in run.run_dir.iterdir())
    with pytest.raises(UserError, match="model's config differs"):
        _drive(Counter(run.run_dir, rounds=3, model="m2"), resume=True)
    # records but no checkpoint: nothing to continue from
    lost = Counter(tmp_path / "lost", rounds=2)
    _drive(lost, every=0)
    with pytest.raises(UserError, match="no readable checkpoint"):
        _drive(Counter(lost.run_dir, rounds=3), resume=True)
    assert sorted(p.name for p in run.run_dir.iterdir()) == before


def test_resume_takes_a_checkpoint_whose_head_names_its_labels_otherwise(tmp_path: Path) -> None:
    """Label names change nothing the model computes: LABEL_0 in the checkpoint, a name now."""
    run = Counter(tmp_path / "run", rounds=2)
    _drive(run, every=1)
    again = Counter(run.run_dir, rounds=3, labels="fresh")
    assert _drive(again, resume=True)["total"] == 6.0
    assert again.calls[0] == "resume 2"


def test_resume_without_a_checkpoint_restarts_a_run_that_finished_no_round(tmp_path: Path) -> None:
    run = Counter(tmp_path / "run", rounds=2)
    with pytest.raises(KeyboardInterrupt):
        _drive(run, hook=lambda r, rec: (_ for _ in ()).throw(KeyboardInterrupt()), every=0)
    (run.run_dir / "metrics.jsonl").write_text("")  # as if killed before round 1 ended
    again = Counter(run.run_dir, rounds=2)
    assert _drive(again, resume=True)["total"] == 3.0
    assert again.calls[0] == "start 0"


def test_check_run_dir_never_overwrites_and_counts_the_runs_own_files(tmp_path: Path) -> None:
    same = lambda saved: []  # noqa: E731
    fresh = tmp_path / "fresh"
    driver.check_run_dir(fresh, False, same)  # nothing there: fine
    fresh.mkdir()
    (fresh / "model").mkdir()
    driver.check_run_dir(fresh, False, same)  # not a result file of the driver's
    with pytest.raises(UserError, match=r"already holds a run \(model\)"):
        driver.check_run_dir(fresh, False, same, output_names=["model"])
    with pytest.raises(UserError, match="nothing to resume"):
        driver.check_run_dir(fresh, True, same)
    (fresh / "config.json").write_text('{"lr": 1}')
    with pytest.raises(UserError, match=r"differ from the saved run \(lr\)"):
        driver.check_run_dir(fresh, True, lambda saved: ["lr"] if saved["lr"] != 2 else [])


def test_the_stop_hook_and_the_interrupted_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv(driver.STOP_ENV, raising=False)
    assert driver.stop_hook_from_env() is None
    monkeypatch.setenv(driver.STOP_ENV, "2")
    hook = driver.stop_hook_from_env()
    hook(1, {})
    with pytest.raises(KeyboardInterrupt):
        hook(2, {})
    run = Counter(tmp_path / "run", rounds=4)
    with pytest.raises(KeyboardInterrupt):
        _drive(run, every=1, hook=hook)
    assert driver.interrupted(run.run_dir) == 130
    err = capsys.readouterr().err
    assert err == (f"interrupted (last checkpoint: round 2; continue with the same flags plus "
                   f"--resume --output-dir {run.run_dir})\n")  # fmt: skip
    assert driver.interrupted(None) == 130
    assert capsys.readouterr().err == "interrupted (no checkpoint yet)\n"


def test_due_every_n_rounds_and_after_the_last_never_for_0() -> None:
    assert [r for r in range(1, 11) if driver.due(r, 4, 10)] == [4, 8, 10]
    assert [r for r in range(1, 4) if driver.due(r, 1, 3)] == [1, 2, 3]
    assert not any(driver.due(r, 0, 3) for r in range(1, 4))


@pytest.mark.parametrize(
    ("figures", "stops"),
    [
        ({"clients_sampled": [0, 1], "clients_rejected": [0, 1]}, True),
        ({"clients_sampled": [0, 1, 2], "clients_rejected": [0, 2], "clients_failed": [1]}, True),
        ({"clients_sampled": [0, 1, 2], "clients_rejected": [0, 2]}, False),
        ({"clients_sampled": [], "clients_rejected": []}, False),  # DP's Poisson drew nobody
        ({"clients_sampled": [0, 1], "clients_rejected": [], "clients_failed": [0, 1]}, False),
        ({"clients_rejected": [1]}, False),  # pre-training's record: its own check
    ],
)
def test_a_round_whose_every_upload_was_rejected_stops_the_run_and_keeps_the_rounds_before(
    tmp_path: Path, figures: dict, stops: bool
) -> None:
    class Diverging(Counter):
        def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
            record = super().step(r, history)
            return {**record, **figures} if r == 3 else record

    run = Diverging(tmp_path / "run", rounds=4)
    if not stops:
        assert _drive(run, every=2)["rounds"] == 4
        return
    with pytest.raises(UserError, match=r"^round 3: every upload was rejected \(not finite"):
        _drive(run, every=2)
    assert [r["round"] for r in outputs.read_jsonl(run.run_dir / "metrics.jsonl")] == [1, 2]
    assert RunCheckpointer(checkpoint_dir(run.run_dir)).all_rounds() == [2]

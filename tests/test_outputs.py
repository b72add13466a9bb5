"""Run-directory files: atomic JSON (NaN -> null), JSONL append/rewrite, progress output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fedjax_split.run import outputs


def test_write_json_is_strict_json_and_leaves_no_temp(tmp_path: Path) -> None:
    p = outputs.write_json(tmp_path / "s.json", {"a": float("nan"), "b": [1.5, float("inf")]})
    assert json.loads(p.read_text()) == {"a": None, "b": [1.5, None]}
    assert "NaN" not in p.read_text() and [x.name for x in tmp_path.iterdir()] == ["s.json"]


def test_jsonl_append_then_rewrite_truncates(tmp_path: Path) -> None:
    p = tmp_path / "metrics.jsonl"
    assert outputs.read_jsonl(p) == []
    for r in range(1, 5):
        outputs.append_jsonl(p, {"round": r, "loss": 1.0 / r})
    rows = outputs.read_jsonl(p)
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    outputs.write_jsonl(p, rows[:2])
    assert p.read_text().count("\n") == 2 and outputs.read_jsonl(p) == rows[:2]
    with p.open("a") as f:
        f.write('{"round": 3, "lo')  # killed mid-append
    assert outputs.read_jsonl(p) == rows[:2]


def test_existing_results(tmp_path: Path) -> None:
    assert outputs.existing_results(tmp_path / "none") == []
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "unrelated.txt").write_text("")
    assert outputs.existing_results(tmp_path) == ["metrics.jsonl", "checkpoints"]


_RECORD = {"round": 3, "train_loss": 0.25, "accuracy": 0.875, "cum_bytes": 2_500_000,
           "seconds": 1.5, "eval_seconds": 0.0}  # fmt: skip


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    bar = outputs.Progress(4, enabled=True, stream=stream)
    bar.note("hello")
    bar.round_done(_RECORD, "accuracy")
    bar.close()
    assert stream.getvalue().splitlines() == [
        "hello",
        "round 3 | loss 0.2500 | accuracy 0.8750 | sent 2.5 MB | 1.5s",
    ]
    line = outputs.format_round({**_RECORD, "train_seconds": 1.25, "eval_seconds": 0.25}, None)
    assert line.endswith("| 1.5s (eval 0.2s)")  # the evaluation's share, when it ran


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tqdm_bar_on_a_terminal_and_silence_when_disabled() -> None:
    stream = _Tty()
    bar = outputs.Progress(4, initial=2, enabled=True, stream=stream)
    bar.round_done(_RECORD, "accuracy")
    bar.close()
    text = stream.getvalue()
    assert "3/4" in text and "accuracy 0.8750" in text
    quiet = io.StringIO()
    off = outputs.Progress(4, enabled=False, stream=quiet)
    off.note("x")
    off.round_done(_RECORD, "accuracy")
    assert quiet.getvalue() == ""


def test_check_run_dir_rules(tmp_path) -> None:
    """A fresh run never overwrites results; --resume needs a readable, matching config.json."""
    from fedjax_split.errors import UserError
    from fedjax_split.run.outputs import check_run_dir

    same = lambda saved: []  # noqa: E731
    check_run_dir(tmp_path, False, [], same)  # fresh, empty: fine
    with pytest.raises(UserError, match="already holds a run \\(metrics.jsonl\\)"):
        check_run_dir(tmp_path, False, ["metrics.jsonl"], same)
    with pytest.raises(UserError, match="nothing to resume"):
        check_run_dir(tmp_path, True, [], same)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="unreadable"):
        check_run_dir(tmp_path, True, [], same)
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    seen = []
    check_run_dir(tmp_path, True, ["metrics.jsonl"], lambda saved: seen.append(saved) or [])
    assert seen == [{"lr": 0.1}]  # the saved settings reach the comparison
    with pytest.raises(UserError, match="differ from the saved run \\(lr\\)") as e:
        check_run_dir(tmp_path, True, [], lambda saved: ["lr"])
    assert "\n" not in str(e.value)


def test_summary_is_rounded_for_reading_with_exact_bytes_beside_megabytes(tmp_path) -> None:
    summary = {
        "final": {"accuracy": 0.834733893557423, "seconds": 12.345678, "cum_bytes": 1241422848,
                  "clients": [{"client": 0, "accuracy": 2 / 3}]},
        "best": 0.8, "share": 0.000123456789, "loss": 12.3456789, "rounds": 3, "resume": False,
        "cum_bytes": 1241422848, "checkpoint_seconds": 0.04, "missing": None, "zero": 0.0,
    }  # fmt: skip
    got = outputs.read_json(outputs.write_summary(tmp_path / "summary.json", summary))
    assert got["final"] == {"accuracy": 0.8347, "seconds": 12.3, "cum_bytes": 1241422848,
                            "cum_mb": 1241.4, "clients": [{"client": 0, "accuracy": 0.6667}]}
    assert (got["best"], got["share"], got["loss"]) == (0.8, 0.0001235, 12.3457)
    assert (got["cum_bytes"], got["cum_mb"], got["checkpoint_seconds"]) == (1241422848, 1241.4, 0.0)
    assert (got["rounds"], got["resume"], got["missing"], got["zero"]) == (3, False, None, 0.0)
    assert list(got)[list(got).index("cum_bytes") + 1] == "cum_mb"  # read side by side
    assert summary["final"]["accuracy"] == 0.834733893557423  # the caller's dict is untouched

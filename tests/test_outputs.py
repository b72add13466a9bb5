"""Run-directory files: atomic JSON (NaN -> null), JSONL append/rewrite, progress output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fedjax_split.run import outputs
from fedjax_split.sim.rounds import RoundProgress


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


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _inside(done: int, steps: int = 100, clients: int = 4) -> RoundProgress:
    return RoundProgress(done * clients // steps, clients, done, steps, 10 * done)


def test_lines_inside_a_round_are_rate_limited_and_the_time_left_ignores_compiling() -> None:
    """Off a terminal: the compile line, the first progress report at once, then at most one line
    every LINE_SECONDS (fake clock), the round's line; after the first round the time left comes
    from the steady part of the round (from its first report on), not from its compiling."""
    stream, clock = io.StringIO(), _Clock()
    bar = outputs.Progress(5, enabled=True, stream=stream, clock=clock)
    hook = bar.round_hook()
    assert hook is not None
    bar.round_start(1)
    bar.compiling(1)
    clock.now = 600.0  # compiling: ten minutes
    hook(_inside(10))
    for t in range(1, 31):  # 90 more steps in 30 s: 3 s a step, 10 steps (100 examples) in 30 s
        clock.now = 600.0 + t
        hook(_inside(10 + 3 * t))
    clock.now = 633.0  # the round's end: 90 steps in 33 s since the first report
    bar.round_done({**_RECORD, "round": 1}, "accuracy")
    lines = stream.getvalue().splitlines()
    gap = int(outputs.LINE_SECONDS)
    assert lines[0] == "round 1: compiling the client program (the first round only) ..."
    assert lines[1] == "round 1: 0/4 clients done, 10/100 steps"
    assert lines[2] == f"round 1: {(10 + 3 * gap) * 4 // 100}/4 clients done, {10 + 3 * gap}/100 "\
        "steps, 30 examples/s"  # fmt: skip
    assert len(lines) == 3 + 30 // gap  # a line every LINE_SECONDS, then the round's
    # four rounds left of 100 steps at 33 s / 90 steps: 147 s (the round's 633 s: 42 min)
    assert lines[-1].startswith("round 1 | loss") and lines[-1].endswith("| about 2 min left")
    stream.truncate(0)
    stream.seek(0)
    bar2 = outputs.Progress(41, enabled=True, stream=stream, clock=clock)
    bar2.round_start(1)
    clock.now = 1000.0
    bar2.round_hook()(_inside(10))
    clock.now = 1090.0  # 90 steps in 90 s: the round's steady time is 100 s
    bar2.round_done({**_RECORD, "round": 1}, None)
    assert stream.getvalue().splitlines()[-1].endswith("| about 67 min left")  # 40 x 100 s
    bar2.round_start(2)
    clock.now = 1090.0 + 30.0  # later rounds: their own (mean) time
    bar2.round_done({**_RECORD, "round": 2}, None)
    assert stream.getvalue().splitlines()[-1].endswith("| about 20 min left")  # 39 x 30 s
    bar2.round_start(3)
    clock.now += 330.0
    bar2.round_done({**_RECORD, "round": 3}, None)
    assert stream.getvalue().splitlines()[-1].endswith("| about 1.9 h left")  # 38 x 180 s


def test_inside_a_round_on_a_terminal_the_bar_says_it_and_disabled_hooks_nothing() -> None:
    stream, clock = _Tty(), _Clock()
    bar = outputs.Progress(2, enabled=True, stream=stream, clock=clock)
    bar.round_start(1)
    bar.round_hook()(_inside(10))
    clock.now = 5.0
    bar.round_hook()(_inside(60))
    text = stream.getvalue()
    assert "round 1: 0/4 clients done, 10/100 steps" in text
    assert "round 1: 2/4 clients done, 60/100 steps, 100 examples/s" in text
    assert "0/2" in text and "remaining" not in text and "<" not in text  # no tqdm time left
    bar.close()
    assert outputs.Progress(2, enabled=False).round_hook() is None  # the round waits for nothing
    assert outputs.time_left(59) == "under a minute left"
    assert outputs.time_left(89 * 60) == "about 89 min left"


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


def test_the_first_rounds_time_left_follows_its_second_half() -> None:
    """Programs of new shapes compile all through a first round: its first half is slow, its
    second half is what later rounds cost. 50 steps in 100 s, then 50 in 10 s (0.2 s a step) and
    2 s after the last report: 22 s a round, four left: 88 s (the first-report rule would say
    8 min)."""
    stream, clock = io.StringIO(), _Clock()
    bar = outputs.Progress(5, enabled=True, stream=stream, clock=clock)
    bar.round_start(1)
    hook = bar.round_hook()
    for t, done in [(0.0, 1), (50.0, 25), (100.0, 50), (105.0, 75), (110.0, 100)]:
        clock.now = t
        hook(_inside(done))
    clock.now = 112.0
    bar.round_done({**_RECORD, "round": 1}, None)
    assert stream.getvalue().splitlines()[-1].endswith("| about 1 min left")


def test_training_says_only_the_first_round_compiles() -> None:
    stream = io.StringIO()
    bar = outputs.Progress(3, enabled=True, stream=stream, clock=_Clock())
    for r in (1, 2):
        bar.round_start(r)
        assert bar.training("X") is not None
        bar.round_done({**_RECORD, "round": r}, None)
    lines = stream.getvalue().splitlines()
    assert [x for x in lines if "compiling" in x] == ["round 1: compiling X ..."]
    assert outputs.Progress(3, enabled=False).training() is None

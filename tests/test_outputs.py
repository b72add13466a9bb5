"""Run-directory files: atomic JSON (NaN -> null), JSONL append/rewrite, progress output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fedjax_split.run import outputs
from fedjax_split.sim.round_progress import RoundProgress


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
        "round 3 | loss 0.2500 | accuracy 0.8750 | sent 2.5 MB | 1.5s | under a minute left",
    ]  # one round left (of 4, from round 3) at 1.5 s: the estimate from the first round on
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
    every LINE_SECONDS (fake clock), the round's line; its time left from the round's wall time
    less the seconds XLA compiled in it (the record's compile_seconds)."""
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
    clock.now = 633.0  # the round's end, 600 s of it compiling
    bar.round_done({**_RECORD, "round": 1, "compile_seconds": 600.0}, "accuracy")
    lines = stream.getvalue().splitlines()
    gap = int(outputs.LINE_SECONDS)
    assert lines[0] == "round 1: compiling the client program (the first round only) ..."
    assert lines[1] == "round 1: 0/4 clients done, 10/100 steps"
    assert lines[2] == f"round 1: {(10 + 3 * gap) * 4 // 100}/4 clients done, {10 + 3 * gap}/100 "\
        "steps, 30 examples/s"  # fmt: skip
    assert len(lines) == 3 + 30 // gap  # a line every LINE_SECONDS, then the round's
    # four rounds left at 633 - 600 = 33 s: 132 s (with the compiling: 42 min)
    assert lines[-1].startswith("round 1 | loss") and lines[-1].endswith("| about 2 min left")


def test_the_time_left_excludes_compiling_by_hand() -> None:
    """Six rounds, records with known seconds and compile_seconds (no clock: the record's
    seconds). Round 1, 250 s of which 130 compiling: 120 s a round, five left: 600 s (10 min; the
    old extrapolation of 250 s: 21 min). Round 2, 70 s of which 10 compiling: from then on the
    later rounds' mean, 60 s, four left: 240 s. Round 3, 140 s: (60 + 140) / 2 = 100 s, three
    left: 300 s. The last round: none."""
    stream = io.StringIO()
    bar = outputs.Progress(6, enabled=True, stream=stream)
    for r, seconds, compiled in [(1, 250.0, 130.0), (2, 70.0, 10.0), (3, 140.0, 0.0)]:
        bar.round_done({**_RECORD, "round": r, "seconds": seconds,
                        "compile_seconds": compiled}, None)  # fmt: skip
    lines = stream.getvalue().splitlines()
    assert [x.rsplit(" | ", 1)[-1] for x in lines] == [
        "about 10 min left", "about 4 min left", "about 5 min left"]
    last = outputs.Progress(1, enabled=True, stream=stream)
    last.round_done({**_RECORD, "round": 1, "compile_seconds": 1.0}, None)
    assert stream.getvalue().splitlines()[-1].endswith("| 1.5s")  # nothing left to estimate


def test_a_wall_clock_round_less_its_compiling_and_later_rounds_by_their_mean() -> None:
    """With round_start, a round's time is the wall clock's (its checkpoint included): 1090 s
    with 990 s compiling is 100 s a round; then 30 s, then 330 s (later rounds' mean: 180 s)."""
    stream, clock = io.StringIO(), _Clock()
    bar = outputs.Progress(41, enabled=True, stream=stream, clock=clock)
    for r, end, compiled, want in [(1, 1090.0, 990.0, "about 67 min left"),  # 40 x 100 s
                                   (2, 1120.0, 0.0, "about 20 min left"),  # 39 x 30 s
                                   (3, 1450.0, 0.0, "about 1.9 h left")]:  # 38 x 180 s
        bar.round_start(r)
        clock.now = end
        bar.round_done({**_RECORD, "round": r, "compile_seconds": compiled}, None)
        assert stream.getvalue().splitlines()[-1].endswith(f"| {want}")


def test_on_a_terminal_every_rounds_line_stays_above_the_bar() -> None:
    """tqdm writes each round's line above the bar (a whole line, ended by a newline) instead of
    into the bar's text, which the next round would overwrite."""
    stream = _Tty()
    bar = outputs.Progress(3, enabled=True, stream=stream)
    for r in (1, 2):
        bar.round_done({**_RECORD, "round": r}, "accuracy")
    bar.close()
    whole = [seg for line in stream.getvalue().split("\n")[:-1] for seg in line.split("\r")]
    for r, left in ((1, "under a minute left"), (2, "under a minute left")):
        assert (f"round {r} | loss 0.2500 | accuracy 0.8750 | sent 2.5 MB | 1.5s | {left}"
                in whole), r  # fmt: skip


def test_dp_rounds_say_epsilon_and_the_budget_left() -> None:
    """A DP record's epsilon in its line, with what is left of --dp-max-epsilon (8 - 2.5 = 5.5);
    no budget: epsilon alone; no noise (epsilon None): no guarantee."""
    record = {**_RECORD, "epsilon": 2.5}
    line = outputs.format_round(record, "accuracy", 8.0)
    assert line == ("round 3 | loss 0.2500 | accuracy 0.8750 | epsilon 2.5 of 8 (5.5 left) | "
                    "sent 2.5 MB | 1.5s")  # fmt: skip
    assert "| epsilon 2.5 | sent" in outputs.format_round(record, "accuracy")
    assert "| no privacy guarantee (z = 0) |" in outputs.format_round(
        {**_RECORD, "epsilon": None}, None)  # fmt: skip
    stream = io.StringIO()
    bar = outputs.Progress(4, enabled=True, stream=stream, epsilon_budget=3.0)
    bar.round_done({**record, "epsilon": 1.25}, None)
    assert "| epsilon 1.25 of 3 (1.75 left) |" in stream.getvalue()


def _summary(final: float, majority: float | None, **extra: object) -> dict:
    return {"primary_metric": "accuracy", "final": {"accuracy": final}, "majority_label": majority,
            "rounds": 3, "cum_bytes": 10**6, "seconds": 5.0, "run_dir": "runs/x", **extra}


def test_a_run_at_or_below_its_majority_label_ends_with_one_warning_line() -> None:
    """The issue's runs: a DP run that ended exactly on the line (0.6869), a FedBT run below it;
    one above it has no warning, nor a run without the figure (a regression task)."""
    from fedjax_split import train

    warning = ("warning: the final accuracy {:.4f} is at or below the majority label's 0.6869: "
               "the model does no better than each client always predicting its most common "
               "training label")  # fmt: skip
    for final in (0.6869, 0.68686, 0.61):  # 0.68686 reads 0.6869, as the done line shows it
        lines = train.done_line(_summary(final, 0.686899)).splitlines()
        assert lines[-1] == warning.format(final)
        assert sum(x.startswith("warning:") for x in lines) == 1
    for summary in (_summary(0.6871, 0.6869), _summary(0.5, None)):
        assert "warning" not in train.done_line(summary)
        assert outputs.below_majority(summary) is None


def test_the_done_line_says_dp_epsilon_and_the_budget_left() -> None:
    from fedjax_split import train

    privacy = {"epsilon": 2.49, "max_epsilon": 2.8, "delta": 1e-5}
    line = train.done_line(_summary(0.8, 0.6, privacy=privacy)).splitlines()[0]
    assert line == ("done: 3 rounds, accuracy 0.8000 (mean over clients), majority label 0.6000; "
                    "epsilon 2.49 of 2.8 (0.31 left) at delta 1e-05; 1.0 MB sent, 5.0 s")
    no_noise = {"noise_multiplier": 0.0, "epsilon": None, "max_epsilon": None}
    assert "; no privacy guarantee (z = 0);" in train.done_line(_summary(0.8, 0.6,
                                                                         privacy=no_noise))
    assert "epsilon" not in train.done_line(_summary(0.8, 0.6))


def test_the_done_line_says_the_worst_client_the_10th_percentile_and_the_gain() -> None:
    """Beside the mean over clients, what the final record has: the worst client's figure, the
    10th percentile, and (a split run) the personalisation gain, signed; only the primary
    metric's; nothing where the record has none (DP keeps them private), an undefined one left
    out."""
    from fedjax_split import train

    final = {"accuracy": 0.8, "f1": 0.7, "worst_client": {"accuracy": 0.6, "f1": 0.1},
             "p10_client": {"accuracy": 0.64}, "personalization_gain": {"accuracy": 0.25}}
    with_spread = lambda: {**_summary(0.8, 0.6), "final": final}  # noqa: E731
    line = train.done_line(with_spread()).splitlines()[0]
    assert line.startswith(
        "done: 3 rounds, accuracy 0.8000 (mean over clients; worst client 0.6000, 10th "
        "percentile 0.6400, personalisation gain +0.2500), majority label 0.6000; "
    )  # fmt: skip
    final["personalization_gain"] = {"accuracy": -0.05}
    assert "personalisation gain -0.0500)" in train.done_line(with_spread())
    final.update(personalization_gain={"accuracy": float("nan")}, p10_client={"accuracy": None})
    assert "(mean over clients; worst client 0.6000)," in train.done_line(with_spread())
    assert outputs.spread_words({"accuracy": 0.8}, "accuracy") == ""


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

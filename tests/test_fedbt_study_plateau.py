"""tools/lib/fedbt_plateau.py's reading of the NERO plateau study from run directories made by hand:
the plateau of a mean curve, the paired t-test and its interval, FedBT at equal cumulative FLOPs,
the queue's order and the warm-up's text, and the section fedbt_study.py's report writes."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from fedjax_split.run.client_data import subsample_indices

_SPEC = importlib.util.spec_from_file_location(
    "fedbt_study", Path(__file__).resolve().parents[1] / "tools" / "fedbt_study.py"
)
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)
plateau = study.fedbt_plateau  # the one module object the report uses


def _run(root: Path, name: str, f1: dict[int, float], flops: int) -> None:
    """A finished run of 12 rounds: `flops` a round, evaluated at the rounds of `f1`."""
    d = root / name
    d.mkdir(parents=True)
    records = [{"round": r, "cum_flops": flops * r} for r in range(1, 13)]
    for x in records:
        if x["round"] in f1:
            x["pooled"] = {"f1": f1[x["round"]]}
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    (d / "summary.json").write_text(json.dumps({"seconds": 60.0}))
    (d / "config.json").write_text("{}")
    (root / f"{name}.log").write_text("commit abc1234\ncmd\n")


def _at(values: list[float]) -> dict[int, float]:
    return dict(zip((3, 6, 9, 12), values, strict=True))


@pytest.fixture()
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """BERT-FL's mean curve 0.11, 0.31, 0.315, 0.318 (plateau at round 6, 600 FLOPs); FedBT at
    50 FLOPs a round reaches 600 at round 12. FedBT - BERT-FL at round 6: -0.10, -0.12, -0.11;
    FedBT at round 12 - BERT-FL at round 6: -0.01, -0.03, -0.02. The MLM start: two seeds,
    BERT-FL 0.05 above MiniLM's everywhere; its FedBT's seed 1 at 10 FLOPs a round never
    reaches 600."""
    root = tmp_path / "runs"
    monkeypatch.setattr(plateau, "RUNS", plateau.Runs(root))
    monkeypatch.setattr(plateau, "FIGURE", tmp_path / "figures" / "plateau.png")
    for s, (d6, d12) in enumerate([(-0.10, -0.01), (-0.12, -0.03), (-0.11, -0.02)]):
        base = [0.1 + 0.01 * s, 0.3 + 0.01 * s, 0.305 + 0.01 * s, 0.308 + 0.01 * s]
        _run(root, f"bertfl_s{s}", _at(base), 100)
        _run(root, f"fedbt_s{s}", _at([0.05, base[1] + d6, 0.25, base[1] + d12]), 50)
        _run(root, f"central_s{s}", _at([0.2, 0.4, 0.4, 0.4]), 100)
        if s < 2:
            _run(root, f"mlm_bertfl_s{s}", _at([x + 0.05 for x in base]), 100)
            _run(root, f"mlm_fedbt_s{s}", _at([0.1, 0.25 + 0.02 * s, 0.3, 0.33]), [50, 10][s])
    return root


def test_paired_gives_the_t_test_and_interval_by_hand() -> None:
    # mean 0.02, sd 0.01, se 0.01/sqrt(3), t = 2 sqrt(3) with 2 dof. With 2 dof the t law has
    # a closed form: P(|T| > t) = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12/14); the 97.5% quantile
    # (2p - 1) / sqrt(2 p (1 - p)) at p = 0.975 is 0.95 / sqrt(0.04875) = 4.30265
    test = plateau.paired([0.01, 0.03, 0.02])
    assert test.n == 3 and test.mean == pytest.approx(0.02) and test.sd == pytest.approx(0.01)
    assert test.p == pytest.approx(1 - math.sqrt(12 / 14))  # 0.0742
    half = 0.95 / math.sqrt(0.04875) * 0.01 / math.sqrt(3)
    assert (test.lo, test.hi) == pytest.approx((0.02 - half, 0.02 + half))  # -0.0048, 0.0448
    assert plateau.paired([0.5]) is None
    same = plateau.paired([0.05, 0.05])
    assert same.sd == 0 and math.isnan(same.p) and same.lo == same.hi == pytest.approx(0.05)


def test_the_plateau_is_the_first_round_no_later_round_beats_by_a_point() -> None:
    curve = [(3, 0.10), (6, 0.30), (9, 0.345), (12, 0.35), (15, 0.352)]
    assert plateau.plateau(curve) == 9  # round 6: 0.345 >= 0.31; round 9: 0.35, 0.352 < 0.355
    assert plateau.plateau([(3, 0.1), (6, 0.2), (9, 0.3)]) is None  # still rising
    assert plateau.plateau([(3, 0.3), (6, 0.29), (9, 0.32)]) is None  # a dip, then a gain
    assert plateau.plateau([(3, 0.3), (6, 0.305)]) == 3
    assert plateau.plateau([(3, 0.3)]) is None  # nothing after it confirms it


def test_gaps_pair_seeds_at_the_plateau_and_at_equal_flops(runs: Path) -> None:
    loaded = plateau.load_all()
    curve = [(r, m) for r, m, _, _ in plateau.mean_curve(list(loaded["bertfl"].values()))]
    assert [r for r, _ in curve] == [3, 6, 9, 12]
    assert [m for _, m in curve] == pytest.approx([0.11, 0.31, 0.315, 0.318])
    assert plateau.plateau(curve) == 6
    diffs, rounds = plateau.gaps(loaded["fedbt"], loaded["bertfl"], 6)
    assert diffs == pytest.approx([-0.10, -0.12, -0.11]) and rounds == [6, 6, 6]
    diffs, rounds = plateau.gaps(loaded["fedbt"], loaded["bertfl"], 6, equal_flops=True)
    assert diffs == pytest.approx([-0.01, -0.03, -0.02]) and rounds == [12, 12, 12]
    assert plateau.flops_round(loaded["mlm_fedbt"][1], 600) is None  # 120 FLOPs by round 12


def test_the_section_gives_the_curve_the_plateau_and_the_paired_rows(runs: Path) -> None:
    text = "\n".join(plateau.section())
    assert "Runs at commit(s) abc1234." in text
    assert "BERT-FL 3, FedBT 3, centralised 3, BERT-FL, MLM start 2, FedBT, MLM start 2" in text
    # round 6: MLM BERT-FL 0.35, 0.36 (sd 0.00707); MLM FedBT 0.25, 0.27 (sd 0.01414)
    row = "| 6 | 0.310 ± 0.010 | 0.200 ± 0.010 | 0.400 ± 0.000 | 0.355 ± 0.007 | 0.260 ± 0.014 |"
    assert row in text
    assert "MiniLM start: BERT-FL's plateau is round 6." in text
    # -0.11 ± 0.01: t = -11 sqrt(3) = -19.05 with 2 dof, p = 1 - t/sqrt(t^2+2) = 0.0027
    p = 1 - math.sqrt(363 / 365)
    half = 0.95 / math.sqrt(0.04875) * 0.01 / math.sqrt(3)
    row = (f"| MiniLM start: FedBT - BERT-FL, both at round 6 | 6 | 3 | -0.110 | 0.010 | "
           f"[{-0.11 - half:+.3f}, {-0.11 + half:+.3f}] | {p:.2g} |")  # fmt: skip
    assert row in text
    row = (f"| MiniLM start: FedBT at equal cumulative FLOPs - BERT-FL at round 6 | 12 | 3 | "
           f"-0.020 | 0.010 | [{-0.02 - half:+.3f}, {-0.02 + half:+.3f}] | "
           f"{1 - math.sqrt(12 / 14):.2g} |")  # fmt: skip
    assert row in text
    # BERT-FL - centralised at 6: -0.10, -0.09, -0.08
    assert "| BERT-FL - centralised, both at round 6 | 6 | 3 | -0.090 | 0.010 |" in text
    # the MLM start's own plateau: its mean 0.155, 0.355, 0.36, 0.363 -> round 6; its FedBT
    # minus BERT-FL there: 0.25 - 0.35, 0.27 - 0.36; at equal FLOPs seed 0 alone (round 12)
    assert "MLM start: BERT-FL's plateau is round 6." in text
    assert "| MLM start: FedBT - BERT-FL, both at round 6 | 6 | 2 | -0.095 | 0.007 |" in text
    assert ("| MLM start: FedBT at equal cumulative FLOPs - BERT-FL at round 6 | 12 | "
            "1 (1 of 2 never reached it) | -0.020 | - | - | - |") in text  # fmt: skip
    assert (
        "| BERT-FL: MLM start - MiniLM start, both at round 12 | 12 | 2 | +0.050 | 0.000 | "
        "[+0.050, +0.050] | nan |"
    ) in text  # the same difference on both seeds: no test
    assert "![NERO at plateau" in text and plateau.FIGURE.stat().st_size > 0
    assert "- warmup: `--corpus=local" in text and "--lr=1e-4`\n" in text  # not run yet


def test_the_section_gives_the_warmups_figures(runs: Path) -> None:
    d = runs / "warmup_head"
    d.mkdir()
    mlm = {"initial": {"mlm_loss": 10.8, "mlm_accuracy": 0.0}, "unigram": {"mlm_loss": 6.9,
           "mlm_accuracy": 0.05}, "final": {"mlm_loss": 6.25, "mlm_accuracy": 0.1875}}  # fmt: skip
    (d / "summary.json").write_text(json.dumps({**mlm, "train_sequences": 2400, "seconds": 300}))
    (d / "metrics.jsonl").write_text("")
    (d / "config.json").write_text("{}")
    text = "\n".join(plateau.section())
    assert (
        "`: 2400 sequences; held-out MLM loss 10.800 -> 6.250, masked-token accuracy "
        "0.000 -> 0.188 (the unigram level: loss 6.900, accuracy 0.050); 300 s"
    ) in text


def test_the_queue_runs_the_pairs_first_and_the_warmup_before_the_mlm_start() -> None:
    names = [n for n, _, _ in plateau.queue()]
    pairs = [f"{a}_s{s}" for s in range(5) for a in ("bertfl", "fedbt")]
    assert names[:10] == pairs and names[10:15] == [f"central_s{s}" for s in range(5)]
    assert names[15:19] == ["warmup_head", "warmup", "mlm_bertfl_s0", "mlm_fedbt_s0"]
    planned = {n: (args, module) for n, args, module in plateau.queue()}
    assert planned["warmup"][1] == "fedjax_split.pretrain"
    args = planned["mlm_fedbt_s3"][0]
    assert f"--model={plateau.START}" in args and "--layer-schedule=fedbt" in args
    assert "--seed=3" in args and "--rounds=48" in args and "--eval-every=3" in args
    assert "--rounds=36" in planned["bertfl_s1"][0] and "--rounds=36" in planned["central_s1"][0]
    assert sum(a.startswith("--rounds=") for a in args) == 1
    assert "--clients=1" in planned["central_s0"][0]


def test_the_warmup_text_is_every_row_no_seed_subsamples() -> None:
    rows = plateau.warmup_rows(50, 10, (0, 1))
    used = set(subsample_indices(50, 10, 0)) | set(subsample_indices(50, 10, 1))
    assert set(rows) | used == set(range(50)) and not set(rows) & used
    assert rows == sorted(rows) and plateau.warmup_rows(50, 60, (0,)) == []


def test_the_report_keeps_an_earlier_plateau_section_when_its_runs_are_not_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "study.md"
    monkeypatch.setattr(study, "DOC", doc)
    monkeypatch.setattr(study, "DISCUSSION", tmp_path / "none.md")
    monkeypatch.setattr(study, "RUNS", study.Runs(tmp_path / "none"))
    monkeypatch.setattr(plateau, "RUNS", plateau.Runs(tmp_path / "none"))
    kept = [f"## {plateau.TITLE}", "", "Runs at commit(s) 0ld0ne.", ""]
    doc.write_text("\n".join(["# old", "", *kept]))
    study.report()
    assert "\n".join(kept) in doc.read_text()


def test_the_queue_refreshes_the_report_after_each_run_it_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []

    class Fake:
        def run(self, name: str, args: list[str], module: str) -> str:
            ran.append(name)
            return f"{name}: done before" if name == "fedbt_s0" else f"{name}: ok in 1s"

    monkeypatch.setattr(plateau, "RUNS", Fake())
    monkeypatch.setattr(plateau, "write_warmup_text", lambda: ran.append("text"))
    reports: list[int] = []
    plateau.run_queue((0,), after=lambda: reports.append(len(ran)))
    assert ran == ["bertfl_s0", "fedbt_s0", "central_s0", "text", "warmup_head", "warmup",
                   "mlm_bertfl_s0", "mlm_fedbt_s0"]  # fmt: skip
    assert reports == [1, 3, 5, 6, 7, 8]  # after each run but the one done before


def test_the_ledger_keeps_each_finished_runs_figures_when_its_directory_is_gone(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = tmp_path / "data" / "plateau.jsonl"
    kept = plateau.Runs(runs, ledger=ledger)
    before = "\n".join(plateau.section())
    names = sorted(p.name for p in runs.iterdir() if p.is_dir())
    for name in [*names, names[0]]:  # recording a run twice leaves one line
        kept.record(name)
    kept.record("central_s4")  # not run: nothing recorded
    lines = [json.loads(x) for x in ledger.read_text().splitlines()]
    assert sorted(x["name"] for x in lines) == names
    (runs / "unfinished").mkdir()  # a run under way is not taken from the ledger
    assert kept.load("unfinished") is None and kept.load("central_s4") is None
    for name in names:
        for f in (runs / name).iterdir():
            f.unlink()
        (runs / name).rmdir()
        (runs / f"{name}.log").unlink()
    monkeypatch.setattr(plateau, "RUNS", kept)
    assert "\n".join(plateau.section()) == before
    assert kept.run("bertfl_s0", ["--never-run"]) == "bertfl_s0: in the ledger, done before"
    assert not (runs / "bertfl_s0").exists()


def test_a_ledger_line_keeps_the_costs_and_pooled_scores_not_the_client_lists(
    tmp_path: Path,
) -> None:
    d = tmp_path / "runs" / "r"
    d.mkdir(parents=True)
    record = {"round": 3, "flops": 7, "cum_flops": 21, "cum_bytes": 5, "seconds": 1.5,
              "pooled": {"f1": 0.25}, "clients": [{"client": 0, "f1": 0.2}], "f1": 0.2}  # fmt: skip
    (d / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    (d / "summary.json").write_text(json.dumps({"seconds": 60.0}))
    (d / "config.json").write_text("{}")
    (tmp_path / "runs" / "r.log").write_text("commit abc1234\ncmd\ncommit def5678\ncmd\n")
    runs = plateau.Runs(tmp_path / "runs", ledger=tmp_path / "ledger.jsonl")
    runs.record("r")
    (line,) = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert line == {"name": "r", "commits": ["abc1234", "def5678"], "summary": {"seconds": 60.0},
                    "records": [{"round": 3, "flops": 7, "cum_flops": 21, "cum_bytes": 5,
                                 "pooled": {"f1": 0.25}}]}  # fmt: skip

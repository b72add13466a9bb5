"""tools/fedbt_study.py's tables from run directories made by hand: the pooled figure, the shares
of the same seed's BERT-FL run, FedBT's paired difference with BERT-FL and its t-test, and the
runs it would start."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fedbt_study", Path(__file__).resolve().parents[1] / "tools" / "fedbt_study.py"
)
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)


def _run(root: Path, name: str, pooled: list[float], flops: int, up: int, **summary) -> None:
    """A finished run evaluated every round: `flops` and `up` bytes a round."""
    d = root / name
    d.mkdir(parents=True)
    records = [{"round": r + 1, "pooled": {"accuracy": a}, "cum_flops": flops * (r + 1),
                "cum_bytes_up": up * (r + 1)} for r, a in enumerate(pooled)]  # fmt: skip
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    (d / "summary.json").write_text(json.dumps({"seconds": 60.0, **summary}))
    (d / "config.json").write_text("{}")
    (root / f"{name}.log").write_text("commit abc1234\ncmd\n")


@pytest.fixture()
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(study, "RUNS", study.Runs(tmp_path))
    for seed, (base, bt) in enumerate([(0.80, 0.79), (0.82, 0.80), (0.78, 0.78)]):
        _run(tmp_path, f"rt_bertfl_s{seed}", [0.6, base], 100, 1000)
        _run(tmp_path, f"rt_fedbt_s{seed}", [0.5, bt], 50, 200, flops_share_of_bert_fl=0.5)
    _run(tmp_path, "rt_central_s0", [0.7, 0.85], 90, 0)
    return tmp_path


def test_the_table_gives_figures_shares_and_fedbts_paired_difference(runs: Path) -> None:
    lines, curves = study.table("rt")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:] if line.startswith("|")}
    bt = rows["FedBT, cycle of 3 of 6 layers"]
    assert "| 0.790 ± 0.010 (n=3) | 0.790, 0.800, 0.780 | 50.0% | 20.0% | 60 |" in bt
    assert "| 0.850 (n=1) | 0.850 | 90.0% | no communication |" in rows[
        "centralised (one client, all data)"]  # fmt: skip
    # differences -0.01, -0.02, 0.00: mean -0.010, sd 0.010, t = -1.73 with 2 dof: p = 0.23
    note = lines[-1]
    assert "-0.010 ± 0.010 (n=3, paired t-test p = 0.23)" in note and "50.0% of BERT-FL" in note
    assert curves["BERT-FL (FedAvg, whole model)"] == [(1, 0.6), (2, 0.8)]


def test_every_method_runs_at_each_seed_before_the_next_seed() -> None:
    planned = study.runs(["rt"])
    assert [n for n, _ in planned[:5]] == [f"rt_{m}_s0" for m in study.METHODS]
    args = dict(planned)["rt_fedbt_s2"]
    assert "--layer-schedule=fedbt" in args and "--seed=2" in args and "--critical-layer=L" in args
    assert "--model-layers=2" in dict(planned)["rt_trunc2_s0"]
    assert study.main(["--datasets", "imdb"]) == 2


def test_the_report_rewrites_the_sections_whose_runs_are_here_and_keeps_the_others(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc, discussion = tmp_path / "docs" / "study.md", tmp_path / "docs" / "discussion.md"
    doc.parent.mkdir()
    monkeypatch.setattr(study, "DOC", doc)
    monkeypatch.setattr(study, "DISCUSSION", discussion)
    monkeypatch.setattr(study, "FIGURE_DIR", tmp_path / "figures")
    # the plateau study's runs and ledger are not this test's: none here (its ledger in docs/
    # would otherwise write its figure into the checkout)
    monkeypatch.setattr(study.fedbt_plateau, "RUNS", study.Runs(tmp_path / "no_plateau_runs"))
    monkeypatch.setattr(study.fedbt_plateau, "FIGURE", tmp_path / "figures" / "plateau.png")
    rt, news = (f"## {study.DATASETS[d][0]}" for d in ("rt", "news"))
    kept = [news, "", "Runs at commit(s) 0ld0ne.", "", "| an earlier table |", ""]
    doc.write_text("\n".join(["# old", "", rt, "", "| a stale rt table |", "", *kept,
                              "## What the numbers allow", "", "old discussion"]))  # fmt: skip
    discussion.write_text("## What the numbers allow\n\nby hand\n")
    study.report()
    text = doc.read_text()
    assert "a stale rt table" not in text and "Runs at commit(s) abc1234." in text
    assert study.fedbt_plateau.TITLE not in text  # no plateau runs here, none earlier
    assert "| 0.790 ± 0.010 (n=3) |" in text  # rt's table from the runs here
    assert "\n".join(kept) in text  # 20 Newsgroups, whose runs are not here, kept as it was
    assert text.index(rt) < text.index(news) < text.index("by hand")
    assert "old discussion" not in text and text.count("## What the numbers allow") == 1
    assert (tmp_path / "figures" / "fedbt_study_rt.png").stat().st_size > 0
    assert not (tmp_path / "figures" / "fedbt_study_news.png").exists()
    assert not study.pyplot().get_fignums()  # the figure is freed once written

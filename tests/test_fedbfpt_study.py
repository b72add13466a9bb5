"""tools/fedbfpt_study.py's report: tables from run directories, checked against hand-worked
values (shares, steps, paired differences and their t-tests); the paper's 7.04% from BERT-base's
shapes; the runs it plans (the fair study's settings)."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fedbfpt_study", Path(__file__).resolve().parents[1] / "tools" / "fedbfpt_study.py"
)
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)


def _pretrain(root: Path, method: str, flops: float, up: float, cpu: float) -> None:
    d = root / f"pretrain_{method}"
    d.mkdir(parents=True)
    records = []
    for r in (1, 2):  # two rounds, two clients; the second client costs twice the first
        clients = [
            {"layers": [0, 1], "steps": 100 * k + r, "flops": k * flops, "bytes_up": k * up,
             "bytes_down": 0 if r == 1 else k * up, "bytes_down_full": 10 * up,
             "cpu_seconds": k * cpu, "seconds": 2 * k}
            for k in (1, 2)
        ]  # fmt: skip
        records.append({"round": r, "layer": 0, "mlm_loss": 3.0 - r, "cum_flops": r * 3 * flops,
                        "cum_bytes": r * 6 * up, "clients": clients})  # fmt: skip
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    summary = {"layers": 6, "initial": {"mlm_loss": 3.5, "mlm_accuracy": 0.1},
               "final": {"mlm_loss": 1.0, "mlm_accuracy": 0.3}, "cum_flops": 6 * flops,
               "cum_bytes": 12 * up}  # fmt: skip
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.json").write_text("{}")


def _finetune(root: Path, method: str, seed: int, f1: float) -> None:
    d = root / f"nero_{method}_s{seed}"
    d.mkdir(parents=True)
    final = {"f1": f1, "precision": f1 + 0.1, "recall": f1 - 0.1}
    (d / "summary.json").write_text(json.dumps({"final": final}))
    (d / "config.json").write_text("{}")
    (d / "metrics.jsonl").write_text("")


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "RUNS", tmp_path)
    _pretrain(tmp_path, "bert-fl", flops=100e9, up=400e6, cpu=10.0)
    _pretrain(tmp_path, "fedbfpt3", flops=40e9, up=30e6, cpu=5.0)
    for seed, f1 in ((0, 0.5), (1, 0.6)):
        _finetune(tmp_path, "fedbfpt3", seed, f1)
    return {m: study.load(f"pretrain_{m}") for m in ("fedbfpt3", "bert-fl")}


def test_pretrain_table_means_and_shares(runs) -> None:
    header, _, fed, bert = study.pretrain_table(runs)
    cells = [c.strip() for c in fed.split("|")[1:-1]]
    assert cells[2] == "101"  # the fewest steps a client took in a round
    # per round and client: mean of (1x, 2x) = 1.5x; shares against BERT-FL's 1.5x
    assert cells[3:10] == ["60", "40.0%", "7.5", "50.0%", "3.0", "45.0", "7.5%"]
    assert cells[10] == "45.0"  # downloads from round 2 on only
    assert "held-out MLM loss" in header and "3.500 -> 1.000" in fed and bert.count("100.0%") == 3


def test_finetune_table_averages_seeds(runs) -> None:
    rows = study.finetune_table(runs)
    assert len(rows) == 3  # no fine-tuning of bert-fl's model yet: no row
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert cells[1:5] == ["0.5500 ± 0.0707 (n=2)", "0.5000, 0.6000", "0.6500", "0.4500"]
    assert cells[5:7] == ["n/a", "n/a"]  # nothing to pair with yet
    assert cells[7:] == ["0.2", "360"]  # 6 x 40 GFLOP; 12 x 30 MB


def test_paired_differences_and_their_t_test(runs, tmp_path) -> None:
    """FedBFPT minus BERT-FL seed by seed: 0.5 - 0.45, 0.6 - 0.52, 0.55 - 0.5 = 0.05, 0.08,
    0.05: mean 0.06, sd 0.01732, t = 0.06 / (0.01732 / sqrt 3) = 6.0 with 2 dof: p = 0.0267."""
    for seed, f1 in ((0, 0.45), (1, 0.52), (2, 0.5), (3, 0.9)):  # seed 3: FedBFPT has none
        _finetune(tmp_path, "bert-fl", seed, f1)
    _finetune(tmp_path, "fedbfpt3", 2, 0.55)
    assert study.paired("fedbfpt3", "bert-fl") == "+0.0600 ± 0.0173 (n=3, p = 0.027)"
    assert study.paired("fedbfpt3", "none") == "n/a"


def test_finetune_scores_are_the_exact_records_not_the_rounded_summary(runs, tmp_path) -> None:
    """summary.json's final is rounded for reading; the mean over seeds takes metrics.jsonl's."""
    exact = {"round": 2, "f1": 0.55555555, "precision": 0.5, "recall": 0.6}
    (tmp_path / "nero_fedbfpt3_s0" / "metrics.jsonl").write_text(
        json.dumps({"round": 1, "f1": 0.1}) + "\n" + json.dumps(exact) + "\n"
    )
    assert study.finetune_scores("fedbfpt3")[0] == {**exact, "seed": 0}


def test_the_fair_studys_runs() -> None:
    """Two warm-ups, the second from the first; the decoder frozen in every baseline but the
    extra rows; 3- and 4-layer small models; NERO fine-tuned centrally at 5 seeds."""
    planned = dict(study.pretrain_runs())
    assert list(planned)[:2] == ["warmup_head", "warmup"]
    assert f"--model={study.RUNS / 'warmup_head' / 'model'}" in planned["warmup"]
    for m in ("bert-fl", "centralised", "truncated"):
        assert study.FREEZE_DECODER in planned[f"pretrain_{m}"], m
    for m in ("bert-fl-decoder", "centralised-decoder", "fedbfpt3"):
        assert not any(a.startswith("--freeze") for a in planned[f"pretrain_{m}"]), m
    assert "--small-layers=4" in planned["pretrain_fedbfpt4"]
    assert not any(a.startswith("--max-documents") for a in planned["pretrain_bert-fl"])
    tunes = dict(study.finetune_runs())
    assert len(tunes) == 5 * len(study.METHODS) and "--clients=1" in tunes["nero_none_s4"]


def test_the_papers_communication_share_from_bert_base_shapes() -> None:
    lines = study.bert_base_accounting()
    assert "109,514,298" in lines[0] and "7,710,522" in lines[0] and "**7.04%**" in lines[0]


def test_the_pretraining_stage_runs_the_pretrain_module_with_its_commit_logged(
    tmp_path, monkeypatch, capsys
) -> None:
    """main's runs go through study_runs.Runs: `python -m fedjax_split.pretrain` for the
    warm-ups and the further pre-training, each log opened by the commit it ran at."""
    import subprocess

    calls = []

    def fake(cmd, **kw):
        calls.append(cmd)
        return 1  # nothing finishes: the report has no runs to show

    monkeypatch.setattr(study, "RUNS", tmp_path)
    monkeypatch.setattr(subprocess, "call", fake)
    assert study.main(["--only", "pretrain"]) == 0
    assert len(calls) == 2 + len(study.METHODS)
    assert all(c[1:3] == ["-m", "fedjax_split.pretrain"] for c in calls)
    assert calls[0][-1] == f"--output-dir={tmp_path / 'warmup_head'}"
    assert (tmp_path / "warmup.log").read_text().startswith("commit ")
    assert "pretrain_bert-fl: FAILED (exit 1, see" in capsys.readouterr().out

"""tools/fedbfpt_study.py's report: tables from run directories, checked against hand-worked
values; the paper's 7.04% from BERT-base's shapes."""

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
            {"layers": [0, 1], "flops": k * flops, "bytes_up": k * up, "bytes_down": 0 if r == 1
             else k * up, "bytes_down_full": 10 * up, "cpu_seconds": k * cpu, "seconds": 2 * k}
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
    _pretrain(tmp_path, "fedbfpt", flops=40e9, up=30e6, cpu=5.0)
    for seed, f1 in ((0, 0.5), (1, 0.6)):
        _finetune(tmp_path, "fedbfpt", seed, f1)
    return {m: study.load(f"pretrain_{m}") for m in ("fedbfpt", "bert-fl")}


def test_pretrain_table_means_and_shares(runs) -> None:
    header, _, fed, bert = study.pretrain_table(runs)
    cells = [c.strip() for c in fed.split("|")[1:-1]]
    # per round and client: mean of (1x, 2x) = 1.5x; shares against BERT-FL's 1.5x
    assert cells[2:9] == ["60", "40.0%", "7.5", "50.0%", "3.0", "45.0", "7.5%"]
    assert cells[9] == "45.0"  # downloads from round 2 on only
    assert "held-out MLM loss" in header and "3.500 -> 1.000" in fed and bert.count("100.0%") == 3


def test_finetune_table_averages_seeds(runs) -> None:
    rows = study.finetune_table(runs)
    assert len(rows) == 3  # no fine-tuning of bert-fl's model yet: no row
    cells = [c.strip() for c in rows[2].split("|")[1:-1]]
    assert cells[1:4] == ["0.5500", "0.5000, 0.6000", "0.6500"]
    assert cells[5:] == ["0.2", "360"]  # 6 x 40 GFLOP; 12 x 30 MB


def test_finetune_scores_are_the_exact_records_not_the_rounded_summary(runs, tmp_path) -> None:
    """summary.json's final is rounded for reading; the mean over seeds takes metrics.jsonl's."""
    exact = {"round": 2, "f1": 0.55555555, "precision": 0.5, "recall": 0.6}
    (tmp_path / "nero_fedbfpt_s0" / "metrics.jsonl").write_text(
        json.dumps({"round": 1, "f1": 0.1}) + "\n" + json.dumps(exact) + "\n"
    )
    assert study.finetune_scores("fedbfpt")[0] == exact


def test_the_papers_communication_share_from_bert_base_shapes() -> None:
    lines = study.bert_base_accounting()
    assert "109,514,298" in lines[0] and "7,710,522" in lines[0] and "**7.04%**" in lines[0]

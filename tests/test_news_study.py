"""tools/news_study.py: the runs it plans (the centralised ceiling on the preset's documents) and
its table from run directories made by hand."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "news_study", Path(__file__).resolve().parents[1] / "tools" / "news_study.py"
)
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)


def test_the_ceiling_is_one_client_with_every_document_of_the_preset(monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the flags name configs/ from there
    central = study.RUN_LIST["central"][1]
    assert "--config=configs/study_20news.py" in central and "--critical-layer=L" in central
    assert {"--clients=1", "--clients-per-round=all", "--partition=iid"} <= set(central)
    assert study.RUN_LIST["fedavg"][1] == study.PRESET  # the preset itself, nothing changed
    fednlp = study.RUN_LIST["fednlp"][1]  # FedNLP's released client, on the same preset
    assert fednlp[: len(study.PRESET)] == study.PRESET
    assert {"--client-optimizer=sgd", "--lr=5e-5", "--lr-schedule=linear", "--warmup-ratio=0.06",
            "--client-clip-norm=1", "--batch-size=8"} <= set(fednlp)  # fmt: skip
    from fedjax_split.train import config_from_args

    config = config_from_args(fednlp)  # the flags parse and validate, with the preset
    client, fed = config.client, config.federation
    assert (client.client_optimizer, client.lr_schedule, client.batch_size) == ("sgd", "linear", 8)
    assert (config.data.task, fed.clients, fed.rounds) == ("20news", 100, 22)
    assert study.main(["--only", "imdb"]) == 2


def test_the_table_gives_the_last_pooled_figure_and_its_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(study, "RUNS", study.Runs(tmp_path))
    d = tmp_path / "central"
    d.mkdir()
    records = [{"round": 1, "pooled": {"accuracy": 0.61}, "train_loss": 1.5, "cum_flops": 2e15},
               {"round": 2, "pooled": {"accuracy": 0.7}, "train_loss": 0.9, "cum_flops": 4e15},
               {"round": 3, "pooled": None, "train_loss": 0.8, "cum_flops": 6e15}]  # fmt: skip
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    (d / "summary.json").write_text(json.dumps({"seconds": 61.2}))
    (d / "config.json").write_text("{}")
    (tmp_path / "central.log").write_text("commit abc1234\ncmd\n")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in study.table()[2:]}
    central = rows[study.RUN_LIST["central"][0]]
    assert "| 0.7000 | 1: 0.610, 2: 0.700 | 0.800 | 61 |" in central
    assert "not run yet" in rows[study.RUN_LIST["fedavg"][0]]
    assert "| 0.5142 |" in rows["FedNLP: DistilBERT FedAvg, round 22"]
    # the figure: computation in PFLOP against accuracy, evaluated rounds only, finished runs only
    assert study.curves() == {study.RUN_LIST["central"][0]: [(2.0, 0.61), (4.0, 0.7)]}
    monkeypatch.setattr(study, "FIGURE", tmp_path / "fig.png")
    monkeypatch.setattr(study, "DOC", tmp_path / "doc.md")
    monkeypatch.setattr(study, "DISCUSSION", tmp_path / "discussion.md")
    (tmp_path / "discussion.md").write_text("## by hand\n")
    study.report()
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    doc = (tmp_path / "doc.md").read_text()
    assert "(figures/news_study.png)" in doc and doc.rstrip().endswith("## by hand")

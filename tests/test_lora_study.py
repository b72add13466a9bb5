"""tools/lora_study.py's tables (and tools/lib/study_runs.py's run records) from run directories
made by hand: megabytes to reach FedAvg's final accuracy, a client's seconds a round, and a
finished run's commits."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "lora_study", Path(__file__).resolve().parents[1] / "tools" / "lora_study.py"
)
study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study)


def _run(root: Path, name: str, accs: list[float], up: int, seconds: list[float]) -> None:
    """A finished run: one record a round, `up` bytes up and down each round, 10 clients."""
    d = root / name
    d.mkdir(parents=True)
    records = [{"round": r + 1, "clients_sampled": list(range(10)), "accuracy": a,
                "bytes_up": up, "cum_bytes": 2 * up * (r + 1), "train_seconds": s}
               for r, (a, s) in enumerate(zip(accs, seconds, strict=True))]  # fmt: skip
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    summary = {"global_params": up // 4, "local_params_per_client": 10}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "config.json").write_text("{}")
    (root / f"{name}.log").write_text("commit abc1234\ncmd\ncommit def5678\ncmd --resume\n")


@pytest.fixture()
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(study, "RUNS", study.Runs(tmp_path))
    _run(tmp_path, "rt_fedavg_full_s0", [0.5, 0.6, 0.7], 4_000_000, [30.0, 20.0, 22.0])
    _run(tmp_path, "rt_fedavg_r8_lr2e-3_s0", [0.55, 0.7, 0.72], 40_000, [25.0, 10.0, 12.0])
    _run(tmp_path, "rt_fedsplit_r8_lr2e-3_s0", [0.6, 0.65, 0.69], 20_000, [25.0, 9.0, 9.0])
    # a second seed of two settings: its own FedAvg target (0.6)
    _run(tmp_path, "rt_fedavg_full_s1", [0.5, 0.6, 0.6], 4_000_000, [30.0, 20.0, 22.0])
    _run(tmp_path, "rt_fedavg_r8_lr2e-3_s1", [0.62, 0.64, 0.66], 40_000, [25.0, 14.0, 16.0])
    return tmp_path


def test_megabytes_to_reach_fedavgs_final_accuracy_by_hand(runs: Path) -> None:
    fedavg = study.RUNS.load("rt_fedavg_full_s0")
    assert study.mb_to_reach(fedavg, 0.7) == 24.0  # round 3: 2 x 4 MB x 3 rounds
    lora = study.RUNS.load("rt_fedavg_r8_lr2e-3_s0")
    assert study.mb_to_reach(lora, 0.7) == 0.16  # round 2: 2 x 0.04 MB x 2 rounds
    assert study.mb_to_reach(study.RUNS.load("rt_fedsplit_r8_lr2e-3_s0"), 0.7) is None
    assert study.client_seconds(lora) == pytest.approx(1.1)  # rounds 2-3: 10 s, 12 s over 10


def test_the_table_has_a_row_per_finished_run_and_says_not_reached(runs: Path) -> None:
    lines, curves, prior = study.table("rt")
    assert prior is None  # the hand-made summaries hold no majority_label
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert set(rows) == {"FedAvg, full model", "FedAvg, LoRA r=8", "FedSplitBERT c=3, LoRA r=8"}
    assert "| 0.650 ± 0.071 (n=2) (0.700, 0.600) | 24.00 | 24.00, 16.00 |" in rows[
        "FedAvg, full model"]  # fmt: skip
    # seed 0 reaches 0.7 at round 2, seed 1 its 0.6 at round 1; seconds: (1.1 + 1.5) / 2
    assert "| 0.04 | 0.690 ± 0.042 (n=2) (0.720, 0.660) | 0.24 | 0.16, 0.08 | 1.30 |" in rows[
        "FedAvg, LoRA r=8"]  # fmt: skip
    assert "| 0.690 (n=1) | 0.12 | not reached |" in rows["FedSplitBERT c=3, LoRA r=8"]
    assert curves["FedAvg, LoRA r=8"] == [(0.08, 0.55), (0.16, 0.7), (0.24, 0.72)]
    assert study.RUNS.commits(["rt_fedavg_full_s0", "nope"]) == ["abc1234", "def5678"]
    assert study.RUNS.load("nope") is None
    check, _, _ = study.table("rt", [("fedavg", 8, "5e-4"), ("fedavg", 8, "2e-3")], seeds=(0,))
    assert len(check) == 3  # the header, its rule and the one finished row (no 5e-4 run here)
    assert check[2].startswith("| FedAvg, LoRA r=8 | ")


def test_a_finished_study_run_keeps_its_figures_not_its_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs.run deletes a finished run's checkpoints and personal parts; a failed run keeps them
    (it resumes from them)."""
    import subprocess

    def fake_train(cmd, **kw):  # what `python -m fedjax_split.train` leaves behind
        out = Path(cmd[-1].removeprefix("--output-dir="))
        (out / "checkpoints" / "3").mkdir(parents=True)
        (out / "clients").mkdir()
        (out / "metrics.jsonl").write_text("{}\n")
        if "ok" in out.name:
            (out / "summary.json").write_text("{}")
        return 0 if "ok" in out.name else 1

    monkeypatch.setattr(subprocess, "call", fake_train)
    runs = study.Runs(tmp_path)
    assert runs.run("ok_run", ["--rounds=3"]).startswith("ok_run: ok")
    assert sorted(p.name for p in (tmp_path / "ok_run").iterdir()) == ["metrics.jsonl",
                                                                       "summary.json"]  # fmt: skip
    assert "FAILED" in runs.run("bad_run", ["--rounds=3"])
    assert (tmp_path / "bad_run" / "checkpoints" / "3").is_dir()

"""tools/reproduce.py's report: tables from run directories, checked against hand-worked values."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fedjax_split.run.config import ExperimentConfig

_SPEC = importlib.util.spec_from_file_location(
    "reproduce", Path(__file__).resolve().parents[1] / "tools" / "reproduce.py"
)
reproduce = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(reproduce)


def _run(root: Path, name: str, accs, per_round_bytes, extra=(), down=None, **config):
    """A finished run directory; `extra[i]` adds fields to round i+1's record; `down`: bytes
    sent to the clients a round (default: as many as they upload)."""
    d = root / name
    d.mkdir(parents=True)
    base = ExperimentConfig.of(algorithm="fedavg", critical_layer=6, clients=10)
    cfg = {**base.to_dict(), **config}
    (d / "config.json").write_text(json.dumps(cfg))
    records, cum = [], 0
    sampled = list(range(cfg["clients_per_round"] or cfg["clients"]))
    down = per_round_bytes if down is None else down
    for r, acc in enumerate(accs, 1):
        cum += per_round_bytes + down
        records.append({"round": r, "accuracy": acc, "bytes_up": per_round_bytes,
                        "bytes_down": down, "cum_bytes": cum,
                        "clients_sampled": sampled})  # fmt: skip
        if acc is None:
            del records[-1]["accuracy"]
        records[-1].update(extra[r - 1] if r <= len(extra) else {})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in records) + "\n")
    (d / "summary.json").write_text("{}")


@pytest.fixture
def report(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "k10_fedavg", [0.60, 0.70], 100_000_000, [{}, {"pooled": {"accuracy": 0.65}}])
    _run(runs, "k10_fedsplit_c3", [0.65, 0.75], 50_000_000, down=60_000_000, critical_layer=3)
    _run(runs, "k10_fedsplit_c0", [0.55, 0.58], 0, critical_layer=0)
    _run(runs, "k10_fedadam", [0.60, 0.50], 100_000_000, algorithm="fedadam")
    _run(runs, "k10_fedavg_seed1", [0.7, 0.8], 100_000_000, seed=1)
    _run(runs, "k10_fedavg_seed2", [0.8, 0.9], 100_000_000, seed=2)
    # cross-device: round 1 not evaluated; clients 0, 1, 2 trained at least once of 100
    news = [{"clients_sampled": [0, 1]},
            {"clients_sampled": [1, 2], "trained_mean": {"accuracy": 0.5},
             "pooled": {"accuracy": 0.45}}]  # fmt: skip
    _run(runs, "news_fedavg", [None, 0.3], 100_000_000, news, clients=100, clients_per_round=2)
    _run(runs, "news_fedsplit_c3", [None, 0.4], 50_000_000, [news[0], {**news[1], "pooled": None}],
         critical_layer=3, clients=100, clients_per_round=2)  # fmt: skip
    # freezing: 10 clients a round upload 4 B x 1.5M parameters each
    freeze = [{"pooled": {"accuracy": 0.4}}, {"pooled": {"accuracy": 0.5}}]
    _run(runs, "freeze_E", [0.1, 0.2], 60_000_000, freeze, algorithm="fedavgm", clients=100,
         clients_per_round=10, freeze="embeddings\\.")  # fmt: skip
    with open(runs / "k10_fedavg.commits.jsonl", "w") as f:
        for commit in ("aaa", "aaa", "bbb+dirty"):  # started, finished, resumed later
            f.write(json.dumps({"commit": commit}) + "\n")
    out = tmp_path / "docs" / "results.md"
    out.parent.mkdir()
    reproduce.report(runs, out)
    return out.read_text(), out


def test_method_table_rows_by_hand(report):
    text, _ = report
    # FedAvg: 100 MB up and 100 MB down per round, reaching its final 0.70 after 2 rounds (400
    # MB); FedSplitBERT: 50 up + 60 down, 0.75 >= 0.70 after 2 rounds (220 MB): 400/220 = 1.8x;
    # FedAdam ends at 0.50 after a best of 0.60 and never reaches 0.70. The pooled column: the
    # one global model's figure, n/a where the run has none; the round that reached the target
    # beside its MB; every row is said to be one seed's
    assert "| FedAvg | 0.7000 | 0.7000 | 0.6500 | 100.0 | 200.0 | 400.0 (round 2) | 1.0x |" in text
    assert ("| FedSplitBERT c=3 | 0.7500 | 0.7500 | n/a | 50.0 | 110.0 | 220.0 (round 2) "
            "| 1.8x |") in text  # fmt: skip
    assert text.count(reproduce.ONE_SEED) == 2  # the K=10 and K=3 method tables
    assert "| FedAdam | 0.5000 | 0.6000 | n/a | 100.0 | 200.0 | not reached | n/a |" in text
    assert "| local only (c=0) | 0.5800 | 0.5800 | n/a | 0.0 | 0.0 | not reached | n/a |" in text


@pytest.fixture
def fake_pool(monkeypatch, request):
    """Give the task's pool these labels. The pool is loaded once per process (cached), so the
    cache is cleared before, and after so that no fake labels are left for other tests."""
    from types import SimpleNamespace

    from fedjax_split.data import sources

    def use(labels):
        stand_in = SimpleNamespace(labels=labels)
        monkeypatch.setattr(sources, "load_examples", lambda task, **_: stand_in)
        reproduce.pool_labels.cache_clear()

    request.addfinalizer(reproduce.pool_labels.cache_clear)
    return use


def test_majority_baseline_by_hand(tmp_path, fake_pool):
    fake_pool([0, 0, 1, 1, 1, 0, 1, 0])
    (tmp_path / "partition.json").write_text(json.dumps({"clients": [
        {"train": [0, 1, 2], "test": [5, 6]},  # majority 0; test labels 0, 1: 0.5
        {"train": [3, 4], "test": [7]},  # majority 1; test label 0: 0.0
    ]}))  # fmt: skip
    run = {"dir": tmp_path, "config": ExperimentConfig.of(task="sst2", seed=0).to_dict()}
    # everyone's majority training label is 1 (three of five); the pooled test labels 0, 1, 0
    assert reproduce.majority_baseline(run) == (0.25, 1 / 3)


def test_rows_name_their_run_and_commits(report):
    text, _ = report
    row = next(x for x in text.splitlines() if x.startswith("| FedAvg | 0.7000 | 0.7000"))
    assert row.endswith("| aaa, bbb+dirty |")  # each commit once, in order
    row = next(x for x in text.splitlines() if x.startswith("| FedAdam |"))
    assert row.endswith("k10_fedadam` | not recorded |")


def test_cross_device_table_gives_the_three_figures(report):
    text, _ = report
    assert "| FedAvg | 0.3000 | 0.5000 (3 of 100) | 0.4500 (0.4500) | 100.0 |" in text
    assert ("| FedSplitBERT c=3 | 0.4000 | 0.5000 (3 of 100) | n/a: no single global model "
            "(local parts) | 50.0 |") in text  # fmt: skip


def test_cross_device_table_has_the_label_priors(tmp_path, fake_pool):
    """A local head can learn its client's prior: the table shows what the priors alone score."""
    fake_pool([2, 2, 1, 0, 2, 1, 1, 0, 2])
    _run(tmp_path, "news_fedavg", [0.3], 1_000_000, [{"clients_sampled": [1]}], clients=2,
         clients_per_round=1, task="20news", seed=0, max_examples=None)  # fmt: skip
    (tmp_path / "news_fedavg" / "partition.json").write_text(json.dumps({"clients": [
        {"train": [0, 1, 2], "test": [3, 4]},  # majority 2; test labels 0, 2: 0.5
        {"train": [5, 6, 7], "test": [8]},  # majority 1; test label 2: 0.0
    ]}))  # fmt: skip
    run = reproduce.load(tmp_path, "news_fedavg")
    lines = reproduce.news_table([run], run)
    # only client 1 trained: its prior alone scores 0.0; everyone's majority training label is 1
    # (training labels 2, 2, 1 and 1, 1, 0): the pooled test labels 0, 2, 2 score 0 for it
    prior = next(x for x in lines if x.startswith("| majority label"))
    assert "| 0.2500 | 0.0000 (the 1 FedAvg trained) | 0.0000 |" in prior
    assert "news_fedavg` partition" in prior
    assert reproduce.news_table([run], None)[3].startswith("| FedAvg | 0.3000 |")


def test_freezing_table_against_fednlp(report):
    text, _ = report
    # FedNLP's E row 54.86; ours final 0.5 (best 0.5); 60 MB / 10 clients / 4 B = 1.5M parameters
    assert "| E | 0.5486 | 0.5000 (0.5000) | n/a | 1.50M | 60.0 |" in text
    assert "| E+L0-3 | 0.3068 | not run |" in text


def test_unfinished_runs_are_listed(report):
    text, _ = report
    line = next(x for x in text.splitlines() if x.startswith("**Not finished yet**"))
    assert "`k3_fedavg`" in line and "`freeze_none`" in line
    assert "`k10_fedavg`" not in line and "`freeze_E`" not in line


def test_seed_mean_and_spread(report):
    text, _ = report
    line = next(x for x in text.splitlines() if x.startswith("| FedAvg | 0.7000 | 0.8000"))
    assert "| 0.9000 | 0.8000 | 0.1000 |" in line  # mean 0.8, sample std 0.1
    # seeds 1 and 2 of FedSplitBERT were not run: the row says so rather than inventing values
    assert "| FedSplitBERT c=3 | 0.7500 | n/a | n/a | 0.7500 | n/a |" in text
    # the label-prior row needs each run's partition.json, which these runs lack
    assert "| majority label of each client (no model) | n/a | n/a | n/a | n/a | n/a |" in text


def test_sweep_counts_global_parameters_from_bytes(report):
    text, _ = report
    # 100 MB up per round / 4 bytes / 10 clients = 2.5M global parameters
    assert "| 6 | 12 | 2.50M | 0.7000 | 100.0 |" in text
    assert "| 5 | 10 | n/a | not run |" in text


def test_plots_written_and_linked(report):
    text, out = report
    pngs = sorted((out.parent / "figures").glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    for p in pngs:
        assert f"(figures/{p.name})" in text


def test_git_commit_names_the_checkout_and_what_differs_from_it(tmp_path):
    import subprocess

    def git(*args):
        cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, text=True)

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "x")
    sha = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    assert reproduce.git_commit(tmp_path) == sha
    (tmp_path / "untracked").write_text("not part of the code")
    assert reproduce.git_commit(tmp_path) == sha
    (tmp_path / "f").write_text("2")
    assert reproduce.git_commit(tmp_path) == sha + "+dirty:f"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("1")
    git("add", "docs/a.md")  # staged, not committed: differs from HEAD
    assert reproduce.git_commit(tmp_path) == sha + "+dirty:docs+f"
    git("checkout", "-q", "--", "f")
    git("rm", "-q", "--cached", "docs/a.md")
    assert reproduce.git_commit(tmp_path) == sha
    # a file moved out of the code: both of its sides are named
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "m.py").write_text("x = 1\n" * 20)
    git("add", "code/m.py")
    git("commit", "-qm", "y")
    sha = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    git("mv", "code/m.py", "café.py")
    assert reproduce.git_commit(tmp_path) == sha + "+dirty:café.py+code"
    assert reproduce.git_commit(tmp_path / "nowhere") == "unknown"


def test_run_one_resumes_only_from_a_checkpoint(tmp_path, monkeypatch):
    import sys

    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    monkeypatch.setattr(reproduce, "command", lambda *a: list(argv))
    monkeypatch.setattr(reproduce, "git_commit", lambda: "abc")
    # stopped after round 1, before its first checkpoint (every 2 rounds): start again
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "metrics.jsonl").write_text('{"round": 1}\n')
    reproduce.run_one("early", "preset", [], tmp_path)
    assert (tmp_path / "early.log").read_text() == "[]\n" and not (tmp_path / "early").exists()
    # stopped after the checkpoint of round 2: continue from it
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

    RunCheckpointer(checkpoint_dir(tmp_path / "late")).save(2, {"x": np.zeros(2)}, {})
    reproduce.run_one("late", "preset", [], tmp_path)
    assert (tmp_path / "late.log").read_text() == "['--resume']\n"


def test_run_one_notes_its_commit_before_and_after(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(reproduce, "command", lambda *a: [sys.executable, "-c", "print('ran')"])
    monkeypatch.setattr(reproduce, "git_commit", lambda: "abc")
    assert reproduce.run_one("r", "preset", [], tmp_path).startswith("r: ok in ")
    recs = [json.loads(x) for x in (tmp_path / "r.commits.jsonl").read_text().splitlines()]
    assert [r["commit"] for r in recs] == ["abc", "abc"]
    assert "exit" not in recs[0] and recs[1]["exit"] == 0 and recs[1]["resumed"] is False
    assert (tmp_path / "r.log").read_text() == "ran\n"


def test_every_study_run_resolves_from_its_preset(monkeypatch):
    """Each run's command line, as run_one builds it, parses and resolves; the preset is kept as
    given (with its `:ARG`), and every run has its own name."""
    from fedjax_split import train

    monkeypatch.chdir(reproduce.ROOT)  # the presets name configs/ from the repository root
    names = [name for _, name, _, _ in reproduce.RUNS]
    assert len(set(names)) == len(names)
    for _, name, preset, overrides in reproduce.RUNS:
        args = reproduce.command(preset, overrides, Path("runs/study") / name)[3:]
        config = train.config_from_args(args)
        assert config.config == preset and config.outputs.output_dir == f"runs/study/{name}"
    k10, k3 = (train.config_from_args([f"--config={p}"]) for p in (reproduce.K10, reproduce.K3))
    assert (k10.federation.clients, k3.federation.clients) == (10, 3)

"""tools/plot.py: PNGs from run directories, series, labels from differing settings."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "plot", Path(__file__).resolve().parents[1] / "tools" / "plot.py"
)
plot = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(plot)


def _run(d: Path, c: int | None, accs: list[float | None], per_round: int) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"task": "mrpc", "critical_layer": c, "seed": 0}))
    lines = []
    for i, a in enumerate(accs, 1):
        rec = {"round": i, "train_loss": 0.5, "cum_bytes": 2 * i * per_round}
        if a is not None:
            rec["accuracy"] = a
        lines.append(json.dumps(rec))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_series_skips_rounds_without_the_metric(tmp_path: Path) -> None:
    _, records = plot.load_run(_run(tmp_path / "a", 6, [0.5, None, 0.7], 1_000_000))
    assert plot.series(records, "accuracy") == ([1, 3], [2.0, 6.0], [0.5, 0.7])


def test_labels_name_the_differing_settings() -> None:
    cfgs = [{"task": "mrpc", "critical_layer": None}, {"task": "mrpc", "critical_layer": 6}]
    assert plot.labels_for(cfgs, ["x", "y"]) == ["c=L", "c=6"]
    assert plot.labels_for([{"task": "mrpc"}], ["only"]) == ["only"]


def test_writes_two_pngs(tmp_path: Path) -> None:
    a = _run(tmp_path / "fedavg", None, [0.6, 0.7, 0.8], 1_030_000)
    b = _run(tmp_path / "fedsplit", 6, [0.7, 0.8, 0.85], 510_000)
    paths = plot.plot_runs([a, b], "accuracy", tmp_path / "out" / "fig")
    assert [p.name for p in paths] == ["fig_rounds.png", "fig_mb.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # named legends and dashed reference lines (a baseline, a published figure): each of the
    # two changes the picture on its own, everything else equal
    y = "accuracy (mean over clients)"
    named = plot.plot_runs([a, b], "accuracy", tmp_path / "named" / "fig", ["FedAvg", "c=6"], y)
    refs = plot.plot_runs([a, b], "accuracy", tmp_path / "refs" / "fig", ["FedAvg", "c=6"], y,
                          {"majority label": 0.65, "published": 0.8})  # fmt: skip
    assert [p.name for p in refs] == ["fig_rounds.png", "fig_mb.png"]
    for p, q, r in zip(paths, named, refs, strict=True):
        assert p.read_bytes() != q.read_bytes() != r.read_bytes()


def test_missing_metrics_file_is_a_one_line_error_with_status_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "tools" / "plot.py"
    argv = [sys.executable, str(script), str(tmp_path), "--out", str(tmp_path / "fig")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"error: {tmp_path} has no metrics.jsonl; pass run directories"
    assert not list(tmp_path.glob("fig*"))


def test_dotted_metric_reaches_into_nested_records() -> None:
    records = [
        {"round": 1, "cum_bytes": 1_000_000, "pooled": {"accuracy": 0.4}},
        {"round": 2, "cum_bytes": 2_000_000},  # not evaluated this round
        {"round": 3, "cum_bytes": 3_000_000, "pooled": {"accuracy": 0.5}, "accuracy": 0.9},
    ]
    assert plot.series(records, "pooled.accuracy") == ([1, 3], [1.0, 3.0], [0.4, 0.5])
    assert plot.series(records, "accuracy") == ([3], [3.0], [0.9])


def test_the_round_axis_ticks_on_whole_rounds_only() -> None:
    """Three rounds: matplotlib's own ticks would fall on 1.25, 1.5, ...; ours are whole rounds."""
    from matplotlib.figure import Figure

    from fedjax_split.run import plots

    records = [{"round": i, "cum_bytes": i * 10**6, "accuracy": 0.5 + i / 10} for i in (1, 2, 3)]
    ours, theirs = Figure().subplots(1, 2)
    plots.draw(ours, [("run", records)], "accuracy", "rounds")
    theirs.plot([1, 2, 3], [0.6, 0.7, 0.8])
    fractional = [t for t in theirs.get_xticks() if t != int(t)]
    assert fractional  # what the default would show
    assert [t for t in ours.get_xticks() if t != int(t)] == []


def test_method_labels_read_as_a_person_names_the_run() -> None:
    from fedjax_split.run.plots import method_label

    assert method_label("fedavg", 3, 6, "fp16") == "FedSplitBERT c=3 + fp16 wire"
    assert method_label("fedprox", 3, 6) == "FedSplitBERT c=3 (FedProx)"
    assert method_label("fedadam", 6, 6) == method_label("fedadam", None, 6) == "FedAdam"
    assert method_label("fedavg", 0, 6, "bf16") == "local only (c=0) + bf16 wire"


def test_majority_score_is_each_clients_majority_training_label_on_its_test_split() -> None:
    from types import SimpleNamespace

    import numpy as np

    from fedjax_split.run.plots import majority_score
    from fedjax_split.tasks.registry import get_task

    labels = np.array([1, 1, 0, 1, 0, 0, 0, 1, 1, 0])
    clients = [SimpleNamespace(train=[0, 1, 2], test=[3, 4]),  # predicts 1: 1/2
               SimpleNamespace(train=[5, 6, 7], test=[8, 9, 2]),  # predicts 0: 2/3
               SimpleNamespace(train=[0], test=[])]  # no test split: not in the mean
    assert majority_score(get_task("sst2"), labels, clients, "accuracy") == (1 / 2 + 2 / 3) / 2
    assert majority_score(get_task("stsb"), labels.astype(float), clients, "pearson") is None


def test_safeguard_labels_name_dp_and_the_robust_rule() -> None:
    from fedjax_split.run.plots import safeguard_label

    assert safeguard_label({"aggregator": "mean", "dp_noise_multiplier": None}) == ""
    assert safeguard_label({"dp_noise_multiplier": 1.0, "aggregator": "mean"}) == " + DP z=1"
    assert safeguard_label({"aggregator": "median", "max_update_norm": 0.5}) == (
        " + median + norm <= 0.5"
    )


def test_run_labels_name_the_method_dp_lora_and_fedbt() -> None:
    """The issue's four runs (the quick job's c = 3 of MiniLM's 6 layers): each its own name."""
    from fedjax_split.run.plots import run_label

    plain = {"algorithm": "fedavg", "quantize": "none", "aggregator": "mean"}
    assert run_label(plain, 3, 6) == "FedSplitBERT c=3"
    assert run_label({**plain, "dp_noise_multiplier": 1.0}, 3, 6) == "FedSplitBERT c=3 + DP z=1"
    assert run_label(plain, 3, 6, lora_rank=8) == "FedSplitBERT c=3 + LoRA r=8"
    assert run_label(plain, 6, 6, lora_rank=8) == "FedAvg + LoRA r=8"
    assert run_label(plain, 3, 6, cycle=3) == "FedBT cycle 3"
    assert run_label({**plain, "algorithm": "fedadam", "quantize": "fp16"}, 6, 6, cycle=2) == (
        "FedBT cycle 2 (FedAdam) + fp16 wire"
    )


def _written_run(d: Path, label: str, config: dict, accs: list[float], majority: float) -> Path:
    """A run directory as a run leaves it: config.json, metrics.jsonl, summary.json."""
    _run(d, 3, accs, 1_000_000)
    (d / "config.json").write_text(json.dumps({"task": "rotten_tomatoes", "critical_layer": 3,
                                               "output_dir": str(d), **config}))  # fmt: skip
    (d / "summary.json").write_text(json.dumps({
        "label": label, "method": "FedSplitBERT, c = 3 of 6: ...", "primary_metric": "accuracy",
        "majority_label": majority, "final": {"accuracy": accs[-1]}}))  # fmt: skip
    return d


def _four_runs(tmp_path: Path) -> list[Path]:
    from fedjax_split.run.plots import run_label

    plain = {"algorithm": "fedavg", "quantize": "none", "aggregator": "mean", "seed": 0,
             "lr": 5e-05}  # fmt: skip
    dp = {**plain, "dp_noise_multiplier": 1.0}
    return [_written_run(tmp_path / name, run_label(cfg, 3, 6, **kw), cfg, accs, 0.6869)
            for name, cfg, kw, accs in [
                ("plain", plain, {}, [0.7, 0.8]), ("dp", dp, {}, [0.6, 0.6869]),
                ("lora", {**plain, "lora_rank": 8}, {"lora_rank": 8}, [0.6, 0.75]),
                ("fedbt", {**plain, "layer_schedule": "fedbt"}, {"cycle": 3}, [0.5, 0.6])]]


def test_legends_are_the_methods_the_runs_wrote_and_distinct(tmp_path: Path) -> None:
    """The plain, DP, LoRA and FedBT runs that config fields labelled `c=3, lr=5e-05` twice."""
    runs = _four_runs(tmp_path)
    ax = plot.figures(runs, "accuracy")["rounds"].axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:4] == ["FedSplitBERT c=3", "FedSplitBERT c=3 + DP z=1",
                          "FedSplitBERT c=3 + LoRA r=8", "FedBT cycle 3"]  # fmt: skip


def test_runs_of_one_method_add_what_differs_and_nothing_else(tmp_path: Path) -> None:
    base = {"algorithm": "fedavg", "seed": 0, "lr": 5e-05, "rounds": 3, "data_dir": "d"}
    runs = [_written_run(tmp_path / name, "FedSplitBERT c=3", {**base, **cfg}, [0.7, 0.8], 0.6)
            for name, cfg in [("a", {}), ("b", {"seed": 1, "data_dir": "elsewhere"}),
                              ("c", {"lr": 1e-4})]]  # fmt: skip
    runs.append(_written_run(tmp_path / "d", "FedAvg", base, [0.7, 0.8], 0.6))
    configs = [plot.load_run(r)[0] for r in runs]
    summaries = [plot.load_summary(r) for r in runs]
    assert plot.run_labels(configs, summaries, [r.name for r in runs]) == [
        "FedSplitBERT c=3, lr=5e-05, seed=0", "FedSplitBERT c=3, lr=5e-05, seed=1",
        "FedSplitBERT c=3, lr=0.0001, seed=0", "FedAvg"]  # fmt: skip
    same = plot.run_labels(configs[:1] * 2, summaries[:1] * 2, ["x", "y"])  # nothing differs
    assert same == ["FedSplitBERT c=3, x", "FedSplitBERT c=3, y"]


def test_the_majority_label_line_is_drawn_on_both_figures(tmp_path: Path) -> None:
    """One dashed line at the runs' shared majority-label figure; one per run when they differ;
    none for a metric the figure is not of (it is the primary metric's)."""
    from fedjax_split.run.plots import MAJORITY

    runs = _four_runs(tmp_path / "four")
    for fig in plot.figures(runs, "accuracy").values():
        ax = fig.axes[0]
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert list(lines[MAJORITY].get_ydata()) == [0.6869, 0.6869]
        assert lines[MAJORITY].get_linestyle() == "--"
        assert MAJORITY in [t.get_text() for t in ax.get_legend().get_texts()]
    other = _written_run(tmp_path / "other", "FedAvg", {}, [0.7, 0.8], 0.55)
    ax = plot.figures([runs[0], other], "accuracy")["mb"].axes[0]
    refs = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
            if line.get_label().startswith("majority")}  # fmt: skip
    assert refs == {"majority label (FedSplitBERT c=3)": [0.6869, 0.6869],
                    "majority label (FedAvg)": [0.55, 0.55]}  # fmt: skip
    ax = plot.figures(runs, "f1")["rounds"].axes[0]
    assert not [x for x in ax.get_lines() if x.get_label().startswith("majority")]


def test_a_runs_figure_draws_the_clients_worst_to_best_band_beside_the_mean() -> None:
    """Both panels of plot.png: the mean's line and, in its colour, a band from the worst
    client's figure to the best's at each evaluated round (an undefined figure left out); no
    band where the records have no per-client figures (DP keeps them private) or for a dotted
    metric (one model's figure)."""
    import matplotlib.colors as mcolors
    import numpy as np

    from fedjax_split.run import plots

    nan = float("nan")
    records = [
        {"round": 1, "cum_bytes": 2_000_000, "accuracy": 0.5,
         "clients": [{"client": 0, "accuracy": 0.3}, {"client": 1, "accuracy": 0.7},
                     {"client": 2, "accuracy": nan}]},
        {"round": 2, "cum_bytes": 4_000_000},  # not evaluated
        {"round": 3, "cum_bytes": 6_000_000, "accuracy": 0.8,
         "clients": [{"client": 0, "accuracy": 0.9}, {"client": 1, "accuracy": 0.6},
                     {"client": 2, "accuracy": 0.9}]},
    ]  # fmt: skip
    fig = plots.run_figure(records, "accuracy", "FedSplitBERT c=1", "title", baseline=0.55)
    for ax, xs in zip(fig.axes, ([1, 3], [2.0, 6.0]), strict=True):
        (band,) = ax.collections
        assert band.get_label() == plots.SPREAD
        # the band's outline: along the worst figures, back along the best
        outline = {tuple(np.round(p, 9)) for p in band.get_paths()[0].vertices}
        assert outline >= {(xs[0], 0.3), (xs[1], 0.6), (xs[0], 0.7), (xs[1], 0.9)}
        assert {y for _, y in outline} <= {0.3, 0.6, 0.7, 0.9}
        mean = next(x for x in ax.get_lines() if x.get_label() == "FedSplitBERT c=1")
        assert list(mean.get_ydata()) == [0.5, 0.8]
        assert mcolors.same_color(band.get_facecolor()[0][:3], mean.get_color())
        assert plots.SPREAD in [t.get_text() for t in ax.get_legend().get_texts()]
    private = [{k: v for k, v in r.items() if k != "clients"} for r in records]
    assert not plots.run_figure(private, "accuracy", "x", "t").axes[0].collections
    assert plots.client_range(records, "pooled.accuracy") == ([], [], [], [])

"""Plot runs: a metric vs round (paper Fig. 3) and vs cumulative megabytes sent (Fig. 6).

  python tools/plot.py runs/t6_* --metric accuracy --out plots/t6

Reads each run directory's metrics.jsonl and config.json and writes `<out>_rounds.png` and
`<out>_mb.png`, one line per run, labelled by the settings that differ between the runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from itertools import cycle
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError, report
from fedjax_split.run.outputs import read_json, read_jsonl

_LABEL_KEYS = ("task", "algorithm", "critical_layer", "quantize", "clients", "partition", "alpha",
               "lr", "local_epochs", "seed", "model")  # fmt: skip


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; pass run directories")
    config_path = run_dir / "config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    return config, read_jsonl(metrics_path)


def labels_for(configs: Sequence[dict[str, Any]], names: Sequence[str]) -> list[str]:
    """Label each run by the settings that differ between the runs (its dir name if none do)."""
    keys = [k for k in _LABEL_KEYS if len({json.dumps(c.get(k)) for c in configs}) > 1]
    out = []
    for config, name in zip(configs, names, strict=True):
        parts = []
        for k in keys:
            v = config.get(k)
            if k == "critical_layer":
                parts.append("c=L" if v is None else f"c={v}")
            else:
                parts.append(f"{k}={v}")
        out.append(", ".join(parts) if parts else name)
    return out


def value(record: dict[str, Any], metric: str) -> Any:
    """A record's metric; a dotted name reaches into a nested one (`pooled.accuracy`: the global
    model on the pooled test set, `trained_mean.accuracy`)."""
    for key in metric.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def series(records: Sequence[dict[str, Any]], metric: str) -> tuple[list, list, list]:
    """(rounds, cumulative MB, values) of the rounds where `metric` was evaluated."""
    rows = [r for r in records if value(r, metric) is not None]
    return (
        [r["round"] for r in rows],
        [r["cum_bytes"] / 1e6 for r in rows],
        [value(r, metric) for r in rows],
    )


# reference lines (a no-model baseline, a published figure) told apart by dash and shade of grey,
# so that they never take a run's colour
REFERENCE_STYLES = (("0.45", "--"), ("0.0", ":"), ("0.25", "-."), ("0.6", (0, (8, 3))))


def plot_runs(
    run_dirs: Sequence[str | Path],
    metric: str,
    out: str | Path,
    labels: Sequence[str] | None = None,
    ylabel: str | None = None,
    references: dict[str, float] | None = None,
) -> list[Path]:
    """Write the two PNGs; returns their paths. `labels` name the runs in the legend (default:
    the settings that differ between them); `references` are named horizontal grey lines, each
    dashed its own way (a baseline without a model, a published figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [load_run(d) for d in run_dirs]
    if labels is None:
        labels = labels_for([c for c, _ in loaded], [Path(d).name for d in run_dirs])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, xlabel in (("rounds", "round"), ("mb", "cumulative MB sent (up + down)")):
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
        for (_, records), label in zip(loaded, labels, strict=True):
            rounds, mb, values = series(records, metric)
            ax.plot(rounds if kind == "rounds" else mb, values, marker="o", ms=3, label=label)
        for (name, y), (color, ls) in zip((references or {}).items(), cycle(REFERENCE_STYLES)):
            ax.axhline(y, color=color, ls=ls, lw=1.2, label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel or f"{metric} (mean over clients)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out.with_name(f"{out.name}_{kind}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl)")
    p.add_argument("--metric", default=None, help="metric to plot (default: the task's primary)")
    p.add_argument("--out", default="plots/runs", help="output prefix: <out>_rounds.png, _mb.png")
    args = p.parse_args(argv)
    metric = args.metric
    if metric is None:
        summary = Path(args.runs[0]) / "summary.json"
        metric = read_json(summary)["primary_metric"] if summary.is_file() else None
        metric = metric or "accuracy"
    for path in plot_runs(args.runs, metric, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    from fedjax_split.cli import one_line_warnings

    one_line_warnings()
    try:
        sys.exit(main())
    except UserError as e:  # a one-line error, exit status 2, as the CLI
        sys.exit(report(e))

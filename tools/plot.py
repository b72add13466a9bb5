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
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError, report
from fedjax_split.run.outputs import read_json, read_jsonl
from fedjax_split.run.plots import draw, series, value  # noqa: F401 (tools/reproduce's value)

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
    from matplotlib.figure import Figure

    loaded = [load_run(d) for d in run_dirs]
    if labels is None:
        labels = labels_for([c for c, _ in loaded], [Path(d).name for d in run_dirs])
    runs = [(label, records) for (_, records), label in zip(loaded, labels, strict=True)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind in ("rounds", "mb"):
        fig = Figure(figsize=(6, 4), dpi=120)
        draw(fig.subplots(), runs, metric, kind, ylabel, references)
        fig.tight_layout()
        path = out.with_name(f"{out.name}_{kind}.png")
        fig.savefig(path)
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

"""Plot runs: a metric vs round (paper Fig. 3) and vs cumulative megabytes sent (Fig. 6).

  python tools/plot.py runs/t6_* --metric accuracy --out plots/t6

Reads each run directory's metrics.jsonl, config.json and summary.json and writes
`<out>_rounds.png` and `<out>_mb.png`, one line per run, named by the method the run wrote
(summary.json's `label`: "FedSplitBERT c=3 + DP z=1", "FedBT cycle 3"), with what differs between
runs of the same method (`seed=1`); and the majority-label line (what each client's majority
label alone scores) when the runs wrote one for the metric plotted.
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
from fedjax_split.run.plots import MAJORITY, draw, series, value  # noqa: F401 (reproduce's value)

_LABEL_KEYS = ("task", "algorithm", "critical_layer", "quantize", "clients", "partition", "alpha",
               "lr", "local_epochs", "seed", "model")  # fmt: skip
# settings that say where or how a run ran, not what it computed: never a difference to name
_NOT_A_DIFFERENCE = {"output_dir", "resume", "config", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "chunk_size", "cpu_devices", "coordinator",
                     "num_processes", "process_id", "data_dir", "site_data",
                     "dp_publish_clients", "server_settings"}  # fmt: skip


def load_run(run_dir: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; pass run directories")
    config_path = run_dir / "config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    return config, read_jsonl(metrics_path)


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """The run's summary.json, or {} while it runs (or if it was killed)."""
    path = Path(run_dir) / "summary.json"
    return read_json(path) if path.is_file() else {}


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


def _setting(key: str, v: Any) -> str:
    if key == "model" and isinstance(v, str):
        v = Path(v).name
    return f"{key}={v:g}" if isinstance(v, float) else f"{key}={v}"


def run_labels(
    configs: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], names: Sequence[str]
) -> list[str]:
    """Each run's legend: the method it wrote (summary.json's `label`; a run without one, by the
    settings that differ, `labels_for`), then, among runs of the same method, the settings that
    differ between them and nothing else (its dir name if none do)."""
    fallback = labels_for(configs, names)
    base = [s.get("label") or f for s, f in zip(summaries, fallback, strict=True)]
    out = list(base)
    for label in set(base):
        same = [i for i, b in enumerate(base) if b == label]
        if len(same) < 2:
            continue
        keys = dict.fromkeys([*_LABEL_KEYS, *(k for i in same for k in configs[i])])
        keys = [k for k in keys if k not in _NOT_A_DIFFERENCE
                and len({json.dumps(configs[i].get(k)) for i in same}) > 1]  # fmt: skip
        for i in same:
            parts = [_setting(k, configs[i].get(k)) for k in keys] or [names[i]]
            out[i] = f"{label}, {', '.join(parts)}"
    return out


def majority_lines(
    summaries: Sequence[dict[str, Any]], labels: Sequence[str], metric: str
) -> dict[str, float]:
    """The majority-label lines for `metric` (a run's summary.json has its primary metric's): one
    line when the runs share the figure (the same data and partition), else one per run."""
    found = [
        (label, s["majority_label"])
        for s, label in zip(summaries, labels, strict=True)
        if s.get("primary_metric") == metric and s.get("majority_label") is not None
    ]
    if len({round(v, 4) for _, v in found}) == 1:
        return {MAJORITY: found[0][1]}
    return {f"majority label ({label})": v for label, v in found}


def figures(
    run_dirs: Sequence[str | Path],
    metric: str,
    labels: Sequence[str] | None = None,
    ylabel: str | None = None,
    references: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The two figures ("rounds", "mb": matplotlib Figures); the arguments are `plot_runs`'."""
    from matplotlib.figure import Figure

    loaded = [load_run(d) for d in run_dirs]
    summaries = [load_summary(d) for d in run_dirs]
    if labels is None:
        labels = run_labels([c for c, _ in loaded], summaries, [Path(d).name for d in run_dirs])
    if references is None:
        references = majority_lines(summaries, labels, metric)
    runs = [(label, records) for (_, records), label in zip(loaded, labels, strict=True)]
    out = {}
    for kind in ("rounds", "mb"):
        fig = Figure(figsize=(6, 4), dpi=120)
        draw(fig.subplots(), runs, metric, kind, ylabel, references)
        fig.tight_layout()
        out[kind] = fig
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
    `run_labels`); `references` are named horizontal grey lines, each dashed its own way (a
    baseline without a model, a published figure; default: `majority_lines`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for kind, fig in figures(run_dirs, metric, labels, ylabel, references).items():
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

"""A run's figure: the task metric against rounds and against cumulative megabytes sent, with what
the label prior alone scores as a dashed line; shared with tools/plot.py, which draws many runs.

Drawn on a bare `matplotlib.figure.Figure` (no pyplot), so writing a run's plot.png from a
notebook neither switches the notebook's backend nor leaves figures open in it.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from itertools import cycle
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split import atomic
from fedjax_split.fed.algorithms import ALGORITHMS
from fedjax_split.tasks import registry as tasks

WIRE_NAMES = {"none": "", "fp16": " + fp16 wire", "bf16": " + bf16 wire"}
# reference lines (a no-model baseline, a published figure) told apart by dash and shade of grey,
# so that they never take a run's colour
REFERENCE_STYLES = (("0.45", "--"), ("0.0", ":"), ("0.25", "-."), ("0.6", (0, (8, 3))))
MAJORITY = "majority label of each client (no model)"
SPREAD = "clients: worst to best"  # the band of `draw(spread=True)`
X_LABELS = {"rounds": "round", "mb": "cumulative MB sent (up + down)"}


def method_label(
    algorithm: str, critical_layer: int | None, num_layers: int, quantize: str = "none"
) -> str:
    """How a person names a run: "FedSplitBERT c=3 + fp16 wire", "FedAvg", "local only (c=0)".
    A critical layer of None or the model's depth shares every layer: the server algorithm."""
    wire = WIRE_NAMES.get(quantize, f" + {quantize} wire")
    server = ALGORITHMS[algorithm].title if algorithm in ALGORITHMS else algorithm
    if critical_layer is None or critical_layer >= num_layers:
        return server + wire
    if critical_layer == 0:
        return "local only (c=0)" + wire
    how = "" if algorithm == "fedavg" else f" ({server})"
    return f"FedSplitBERT c={critical_layer}{how}{wire}"


def safeguard_label(settings: Mapping[str, Any]) -> str:
    """The legend's suffix for DP and robust aggregation (a config as a dict): " + DP z=1",
    " + median", " + norm <= 0.5"; "" for the plain mean."""
    parts = []
    if settings.get("dp_noise_multiplier") is not None:
        parts.append(f"DP z={settings['dp_noise_multiplier']:g}")
    if settings.get("aggregator", "mean") != "mean":
        parts.append(str(settings["aggregator"]))
    if settings.get("max_update_norm") is not None:
        parts.append(f"norm <= {settings['max_update_norm']:g}")
    return "".join(f" + {p}" for p in parts)


def run_label(
    settings: Mapping[str, Any], critical_layer: int | None, num_layers: int, *,
    cycle: int | None = None, lora_rank: int | None = None,
) -> str:  # fmt: skip
    """A run's name in a legend, told apart from the other methods: "FedSplitBERT c=3 + DP z=1",
    "FedBT cycle 3", "FedSplitBERT c=3 + LoRA r=8" (`settings`: the config as a dict; `cycle`,
    FedBT's cycle factor; `lora_rank`, LoRA's rank), then the wire and the safeguards."""
    algorithm = str(settings.get("algorithm", "fedavg"))
    if cycle is not None:
        server = ALGORITHMS[algorithm].title if algorithm in ALGORITHMS else algorithm
        label = f"FedBT cycle {cycle}" + ("" if algorithm == "fedavg" else f" ({server})")
    else:
        label = method_label(algorithm, critical_layer, num_layers)
    if lora_rank:
        label += f" + LoRA r={lora_rank}"
    quantize = str(settings.get("quantize", "none"))
    return label + WIRE_NAMES.get(quantize, f" + {quantize} wire") + safeguard_label(settings)


def label_of(config: Any, model: Any) -> str:
    """`run_label` of a fine-tuning run (its ExperimentConfig and built model): summary.json's
    `label`, and its plot.png's legend."""
    return run_label(
        config.to_dict(),
        model.critical_layer,
        model.config.num_hidden_layers,
        cycle=model.cycle_factor,
        lora_rank=model.config.lora.rank if model.config.lora is not None else None,
    )


def value(record: Mapping[str, Any], metric: str) -> Any:
    """A record's metric; a dotted name reaches into a nested one (`pooled.accuracy`: the global
    model on the pooled test set, `trained_mean.accuracy`)."""
    found: Any = record
    for key in metric.split("."):
        found = found.get(key) if isinstance(found, Mapping) else None
    return found


def series(records: Sequence[Mapping[str, Any]], metric: str) -> tuple[list, list, list]:
    """(rounds, cumulative MB, values) of the rounds where `metric` was evaluated."""
    rows = [r for r in records if value(r, metric) is not None]
    return (
        [r["round"] for r in rows],
        [r["cum_bytes"] / 1e6 for r in rows],
        [value(r, metric) for r in rows],
    )


def client_range(
    records: Sequence[Mapping[str, Any]], metric: str
) -> tuple[list, list, list, list]:
    """(rounds, cumulative MB, worst, best) of the clients' own figures of `metric` (the records'
    `clients`) at each evaluation that has them: none where a DP run keeps them private, nor for
    a dotted metric (`pooled.accuracy` is one model's figure). Undefined figures (NaN) are left
    out."""
    rows = []
    for r in records:
        own = [value(c, metric) for c in r.get("clients") or ()]
        own = [v for v in own if v is not None and np.isfinite(v)]
        if own and value(r, metric) is not None:
            rows.append((r["round"], r["cum_bytes"] / 1e6, min(own), max(own)))
    if not rows:
        return [], [], [], []
    rounds, mb, worst, best = (list(col) for col in zip(*rows, strict=True))
    return rounds, mb, worst, best


def draw(
    ax: Any,
    runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]],
    metric: str,
    x: str,
    ylabel: str | None = None,
    references: Mapping[str, float] | None = None,
    spread: bool = False,
) -> None:
    """One panel: each (label, records) run's `metric` against `x` ("rounds": ticks on whole
    rounds only, or "mb"), and `references` as named grey horizontal lines, each dashed its way.
    `spread`: also the band from the worst client's figure to the best's, in the run's colour
    (`client_range`), so that the mean does not hide the clients it averages."""
    from matplotlib.ticker import MaxNLocator

    for label, records in runs:
        rounds, mb, values = series(records, metric)
        (line,) = ax.plot(rounds if x == "rounds" else mb, values, marker="o", ms=3, label=label)
        at_round, at_mb, worst, best = client_range(records, metric) if spread else ([],) * 4
        if worst:
            ax.fill_between(at_round if x == "rounds" else at_mb, worst, best, alpha=0.2, lw=0,
                            color=line.get_color(), label=SPREAD)  # fmt: skip
    for (name, y), (color, ls) in zip((references or {}).items(), cycle(REFERENCE_STYLES)):
        ax.axhline(y, color=color, ls=ls, lw=1.2, label=name)
    if x == "rounds":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(ylabel or f"{metric} (mean over clients)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def majority_score(
    task: tasks.Task, labels: np.ndarray, clients: Sequence[Any], metric: str
) -> float | None:
    """What the label priors alone score, no model: each client predicts its majority training
    label for its whole test split; `metric`'s mean over the clients with test examples (the
    evaluation's mean). None for a task without classes to count (regression, tagging)."""
    if task.is_regression or task.objective.per_token:
        return None
    labels = np.asarray(labels).astype(np.int64)
    scores = []
    for c in clients:
        train = labels[np.asarray(c.train, np.int64)]
        test = labels[np.asarray(c.test, np.int64)]
        if train.size and test.size:
            guess = np.full_like(test, np.bincount(train).argmax())
            scores.append(tasks.compute_metrics(task, guess, test)[metric])
    finite = [s for s in scores if np.isfinite(s)]
    return float(np.mean(finite)) if finite else None


def run_figure(
    records: Sequence[Mapping[str, Any]],
    metric: str,
    label: str,
    title: str,
    baseline: float | None = None,
) -> Any:
    """One run's figure (a matplotlib Figure): `metric`'s mean over clients against rounds and
    against MB sent, side by side, the band of the clients' worst to best figure behind it, the
    majority-label `baseline` dashed. None before any round was evaluated."""
    from matplotlib.figure import Figure

    if not series(records, metric)[0]:
        return None
    fig = Figure(figsize=(10, 4), dpi=110)
    references = {MAJORITY: baseline} if baseline is not None else None
    for ax, x in zip(fig.subplots(1, 2), X_LABELS, strict=True):
        draw(ax, [(label, records)], metric, x, references=references, spread=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def write_run_plot(
    path: str | Path,
    records: Sequence[Mapping[str, Any]],
    metric: str,
    label: str,
    title: str,
    baseline: float | None = None,
) -> Path | None:
    """plot.png of one run (`run_figure`); None (nothing written) before any round was
    evaluated. Written whole or not at all (a reader never sees half a PNG)."""
    fig = run_figure(records, metric, label, title, baseline)
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return atomic.write_bytes(path, buffer.getvalue())


PLOT_FILE = "plot.png"


def write_fine_tuning_plot(
    run_dir: str | Path,
    records: Sequence[Mapping[str, Any]],
    config: Any,
    model: Any,
    baseline: float | None = None,
    publish: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Path | None:
    """A fine-tuning run's plot.png (simulated or on Flower), named by its method and setting;
    `publish`: what the run publishes of a record (DP: no per-client figure, so no band)."""
    if publish is not None:
        records = [publish(dict(r)) for r in records]
    label = label_of(config, model)
    model_name = Path(str(config.model.name)).name
    title = f"{config.data.task}: {config.federation.clients} clients, {model_name}"
    return write_run_plot(Path(run_dir) / PLOT_FILE, records, model.task.primary_metric, label,
                          title, baseline)  # fmt: skip

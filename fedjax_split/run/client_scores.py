"""An evaluation's figures over clients: each client's metrics, their unweighted mean (the
paper's figure), the clients the mean hides (the worst, the 10th percentile) and what a client's
personal model gains over the global one. The simulation and the Flower server write the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedjax_split.tasks import registry as tasks


def score(task: tasks.Task, examples: Any, res: Any) -> dict[str, float]:
    """The task's metrics of one set of predictions (MNLI's groups by each row's pool index, a
    token task's entities by the pool's tag names)."""
    groups = getattr(examples, "groups", None)
    return tasks.compute_metrics(
        task,
        res.predictions,
        res.labels,
        groups=None if groups is None else np.asarray(groups)[res.example_index],
        label_names=getattr(examples, "tag_names", None),
    )


def mean_over_clients(per_client: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Unweighted mean of each metric over clients (the paper's figure).

    A metric undefined for a client (NaN: e.g. Pearson on a constant test split) is left out of
    the mean rather than turning it into NaN; the per-client entry keeps it (null in JSON).
    """
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    mean = {}
    for m in names:
        vals = [pc[m] for pc in per_client if pc.get(m) is not None and np.isfinite(pc[m])]
        mean[m] = float(np.mean(vals)) if vals else float("nan")
    return mean


LOW_PERCENTILE = 10  # `p10_client`: numpy's percentile, its default linear interpolation


def _defined(value: Any) -> bool:
    return value is not None and bool(np.isfinite(value))


def _finite(per_client: Sequence[dict[str, Any]], metric: str) -> list[float]:
    return [float(pc[metric]) for pc in per_client if _defined(pc.get(metric))]


def spread_over_clients(per_client: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The clients the mean hides: `worst_client`, each metric's lowest figure over clients (every
    task's metrics are higher-is-better), and `p10_client`, its 10th percentile (numpy's default,
    linear interpolation between the sorted figures: with n clients, position 0.1 (n - 1)).
    Undefined figures (NaN) are left out as in `mean_over_clients`; NaN where none is left."""
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    worst, low = {}, {}
    for m in names:
        vals = _finite(per_client, m)
        worst[m] = min(vals) if vals else float("nan")
        low[m] = float(np.percentile(vals, LOW_PERCENTILE)) if vals else float("nan")
    return {"worst_client": worst, "p10_client": low}


def personalization_gain(
    per_client: Sequence[dict[str, Any]], global_clients: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """Each metric's mean over clients of (the client's personal model's figure minus the global
    model's, both on the client's own test split); a client enters a metric's mean where both of
    its figures are defined."""
    theirs = {int(g["client"]): g for g in global_clients}
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    gain = {}
    for m in names:
        pairs = [(pc.get(m), theirs.get(pc["client"], {}).get(m)) for pc in per_client]
        diffs = [own - glob for own, glob in pairs if _defined(own) and _defined(glob)]
        gain[m] = float(np.mean(diffs)) if diffs else float("nan")
    return gain


def personalised_record(
    per_client: Sequence[dict[str, Any]],
    trained: set[int] | None,
    global_clients: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An evaluation's record: each metric's mean over all clients (the paper's figure), each
    client's, the worst client's and the 10th percentile (`spread_over_clients`), and
    `trained_mean` over the clients in `trained` (those trained at least once: with partial
    participation the mean over all includes clients that never trained). `global_clients`: the
    global model's figures on each client's test split (a split run's last evaluation), kept
    with `personalization_gain`. Clients without test examples have no figures at all."""
    record: dict[str, Any] = {**mean_over_clients(per_client), "clients": list(per_client)}
    if per_client:
        record.update(spread_over_clients(per_client))
    if trained is not None:
        record["trained_mean"] = mean_over_clients(
            [pc for pc in per_client if pc["client"] in trained]
        )
    if global_clients is not None:
        record["global_clients"] = list(global_clients)
        record["personalization_gain"] = personalization_gain(per_client, global_clients)
    return record

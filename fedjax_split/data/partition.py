"""Client partitions of an example pool: the paper's label schemes and FedNLP's Dirichlet skews.

Everything here is a pure function of (labels, seed): randomness comes from
`np.random.default_rng([seed, purpose])` objects, never from numpy's global state.

Schemes (`partition_clients(scheme=...)`):
- "paper": FedSplitBERT's Table I (K=3) / Table II (K=10) label shares per client; a linear ramp
  of shares for other K or tasks without a row; regression (STS-B): sort by score, K contiguous
  parts. With `fill="exact"` (the default) every client gets exactly its row's shares, within one
  example, and the surplus examples are dropped (reported); `fill="sequential"` fills |D|/K each
  in order (`data.paper_tables`).
- "dirichlet": client j's class shares q_j ~ Dir(alpha * p), p the pool's class prior; with `beta`
  also quantity skew (the combined scheme).
- "quantity": client sizes z ~ Dir(beta * 1), |D_j| = z_j |D|; labels drawn IID (with `alpha`
  too: the combined scheme, same as "dirichlet" with `beta`).
- "iid": equal sizes, uniform random.
Label-driven schemes sample without replacement; Dirichlet skew and the sequential fill fill
clients in order, re-spreading a class that runs out (`data.label_skew`). Each client's share is
then split at random into train / test (test_fraction). Sites with their own data draw nothing
(`site_split`, `sites_partition`). A partition is saved as JSON (`save_partition`) and read back
(`load_partition`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedjax_split import atomic
from fedjax_split.data.label_skew import dirichlet, label_skew, round_to_total
from fedjax_split.data.paper_tables import exact_counts, exact_skew, paper_shares
from fedjax_split.errors import UserError
from fedjax_split.tasks.registry import Task, get_task

SCHEMES = ("paper", "dirichlet", "quantity", "iid")
FILLS = ("exact", "sequential")  # the paper scheme's: exact shares, or |D|/K each filled in order
_FORMAT = "fedjax_split.data.partition/v1"


@dataclasses.dataclass(frozen=True)
class ClientSplit:
    """One client's example indices into the pool (sorted, int64)."""

    train: np.ndarray
    test: np.ndarray

    @property
    def all(self) -> np.ndarray:
        return np.sort(np.concatenate([self.train, self.test]))


@dataclasses.dataclass(frozen=True)
class Partition:
    """Clients' train/test indices plus the parameters that rebuild them."""

    clients: list[ClientSplit]
    scheme: str
    num_clients: int
    seed: int
    num_examples: int
    alpha: float | None = None
    beta: float | None = None
    task: str | None = None
    test_fraction: float = 0.2
    fill: str | None = None  # the paper scheme's fill (FILLS); None for the other schemes
    target_shares: np.ndarray | None = None  # [K, C] the label shares asked of each client
    dropped: int = 0  # examples left out so that every client's shares hold (fill "exact")

    @property
    def train_sizes(self) -> np.ndarray:
        return np.array([c.train.size for c in self.clients], dtype=np.int64)

    @property
    def test_sizes(self) -> np.ndarray:
        return np.array([c.test.size for c in self.clients], dtype=np.int64)


def _validate_labels(labels: np.ndarray, regression: bool) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise UserError(f"partition needs a non-empty 1-D label array, got shape {labels.shape}")
    if regression:
        bad = np.flatnonzero(~np.isfinite(labels.astype(np.float64)))
    elif not np.issubdtype(labels.dtype, np.integer):
        bad = np.flatnonzero(
            ~np.isfinite(labels.astype(np.float64)) | (labels != np.round(labels)) | (labels < 0)
        )
    else:
        bad = np.flatnonzero(labels < 0)
    if bad.size:
        raise UserError(
            f"partition: invalid labels at rows {bad[:5].tolist()} ({bad.size} in all); "
            "class labels must be ids >= 0 and scores finite"
        )
    return labels


def _check_settings(
    scheme: str, fill: str, num_clients: int, test_fraction: float,
    alpha: float | None, beta: float | None,
) -> None:  # fmt: skip
    """UserError for a partition setting that no scheme takes."""
    if scheme not in SCHEMES:
        raise UserError(f"unknown partition scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if fill not in FILLS:
        raise UserError(f"unknown paper fill {fill!r}; choose one of {', '.join(FILLS)}")
    if int(num_clients) < 1:
        raise UserError(f"num_clients must be >= 1, got {num_clients}")
    if not 0.0 <= test_fraction < 1.0:
        raise UserError(f"test_fraction must be in [0, 1), got {test_fraction}")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value is not None and not (np.isfinite(value) and value > 0):
            raise UserError(f"partition {name} must be a positive number, got {value}")
    if scheme in ("paper", "iid") and (alpha is not None or beta is not None):
        raise UserError(f"scheme {scheme!r} takes no alpha/beta; use 'dirichlet' or 'quantity'")
    if scheme == "dirichlet" and alpha is None:
        raise UserError(
            "scheme 'dirichlet' needs --alpha (label skew; add --beta for quantity skew)"
        )
    if scheme == "quantity" and beta is None:
        raise UserError("scheme 'quantity' needs --beta (Dirichlet concentration of client sizes)")


def _checked_labels(
    labels: np.ndarray, task_obj: Task | None, alpha: float | None
) -> tuple[np.ndarray, bool]:
    """(the labels validated, whether they are regression scores); UserError for labels the task
    does not have or a label skew over scores."""
    regression = (
        bool(task_obj.is_regression)
        if task_obj
        else np.issubdtype(np.asarray(labels).dtype, np.floating)
    )
    labels = _validate_labels(labels, regression)
    if task_obj is not None and not regression and labels.max() >= task_obj.num_labels:
        bad = np.flatnonzero(labels >= task_obj.num_labels)
        raise UserError(
            f"partition: task {task_obj.name} has {task_obj.num_labels} classes but rows "
            f"{bad[:5].tolist()} have labels >= {task_obj.num_labels}; check the data's labels"
        )
    if regression and alpha is not None:
        raise UserError("Dirichlet label skew needs class labels; use scheme 'paper' or 'quantity'")
    return labels, regression


def _members(
    labels: np.ndarray, regression: bool, task_obj: Task | None, k: int, rng: np.random.Generator,
    *, scheme: str, alpha: float | None, beta: float | None, fill: str,
) -> tuple[list[np.ndarray], np.ndarray | None, int]:  # fmt: skip
    """(each client's pool indices, the label shares they were drawn to (None without), the
    examples left out) under the scheme; draws from `rng` in a fixed order."""
    n = labels.size
    if beta is not None and scheme in ("dirichlet", "quantity"):
        sizes = round_to_total(dirichlet(rng, np.full(k, float(beta)), 1)[0], n)
    else:
        sizes = np.array([a.size for a in np.array_split(np.arange(n), k)], dtype=np.int64)
    if scheme == "paper" and regression:
        order = np.argsort(labels, kind="stable")  # sorted by score, K contiguous parts
        return np.array_split(order, k), None, 0
    if scheme == "iid" or (scheme == "quantity" and alpha is None):
        perm = rng.permutation(n)
        return np.split(perm, np.cumsum(sizes)[:-1]), None, 0
    class_ids = labels.astype(np.int64)
    num_classes = int(max(class_ids.max() + 1, task_obj.num_labels if task_obj is not None else 0))
    if scheme == "paper":
        shares = paper_shares(k, num_classes, task_obj)
    else:
        prior = np.bincount(class_ids, minlength=num_classes) / n
        shares = dirichlet(rng, float(alpha) * prior, k)
    if scheme == "paper" and fill == "exact":
        counts = exact_counts(shares, np.bincount(class_ids, minlength=num_classes))
        return exact_skew(class_ids, counts, rng), shares, n - int(counts.sum())
    return label_skew(class_ids, shares, sizes, rng), shares, 0


def _train_test(
    members: Sequence[np.ndarray], rng: np.random.Generator, test_fraction: float,
    scheme: str, dropped: int,
) -> list[ClientSplit]:  # fmt: skip
    """Each client's indices shuffled and cut into train and test (sorted); UserError for a
    client left without training examples."""
    clients = []
    for j, idx in enumerate(members):
        idx = rng.permutation(idx)
        n_test = int(np.floor(idx.size * test_fraction + 0.5))
        train, test = np.sort(idx[n_test:]), np.sort(idx[:n_test])
        if train.size == 0:
            raise UserError(
                f"partition {scheme}: client {j} has no training examples ({idx.size} in all"
                + (f"; {dropped} left out to hold the paper's shares" if dropped else "")
                + "); use fewer clients, more examples, a larger beta, or a smaller test fraction"
                + ("" if not dropped else ", or --paper-fill sequential")
            )
        clients.append(ClientSplit(train.astype(np.int64), test.astype(np.int64)))
    return clients


def partition_clients(
    labels: np.ndarray,
    *,
    scheme: str,
    num_clients: int,
    seed: int,
    alpha: float | None = None,
    beta: float | None = None,
    task: str | Task | None = None,
    test_fraction: float = 0.2,
    fill: str = "exact",
) -> Partition:
    """Split the pool (indices 0..len(labels)-1) over `num_clients` clients, then train/test.

    Every example lands in at most one client's train or test split: all of them, except with the
    paper scheme's exact fill (`fill`, see the module docstring), which leaves out the surplus
    that no client's shares can take (`Partition.dropped`). Raises UserError on bad parameters,
    invalid labels, or a client left without training examples.
    """
    _check_settings(scheme, fill, num_clients, test_fraction, alpha, beta)
    task_obj = get_task(task) if task is not None else None
    labels, regression = _checked_labels(labels, task_obj, alpha)
    n, k = labels.size, int(num_clients)
    if n < k:
        raise UserError(f"partition: {n} examples cannot fill {k} clients")
    rng = np.random.default_rng([seed, 0x70617274])  # "part"
    members, shares, dropped = _members(labels, regression, task_obj, k, rng, scheme=scheme,
                                        alpha=alpha, beta=beta, fill=fill)  # fmt: skip
    return Partition(
        clients=_train_test(members, rng, test_fraction, scheme, dropped),
        scheme=scheme,
        num_clients=k,
        seed=int(seed),
        num_examples=n,
        alpha=None if alpha is None else float(alpha),
        beta=None if beta is None else float(beta),
        task=task_obj.name if task_obj else None,
        test_fraction=float(test_fraction),
        fill=fill if scheme == "paper" and not regression else None,
        target_shares=None if shares is None or scheme != "paper" else np.asarray(shares),
        dropped=dropped,
    )


SITES = "sites"  # the scheme of sites with their own data (--site-data): nothing is drawn
_SITE_SPLIT = 0x73697465  # "site": the rng purpose of a site's 80/20 train/test split


def site_split(
    splits: np.ndarray | None, n: int, seed: int, client_id: int, test_fraction: float = 0.2
) -> ClientSplit:
    """One site's train/test split of its own rows 0..n-1: the rows of its train file train and
    those of its dev/test files test (`splits`: each row's file, "train" for training rows);
    without a dev/test file, a random `test_fraction` of its train file tests, drawn from the
    seed and the client id alone, so that a site computes it without the other sites' data."""
    rows = np.arange(int(n), dtype=np.int64)
    train = rows if splits is None else rows[np.asarray(splits) == "train"]
    test = np.setdiff1d(rows, train)
    if test.size == 0:
        rng = np.random.default_rng([int(seed), _SITE_SPLIT, int(client_id)])
        perm = rng.permutation(train)
        n_test = int(np.floor(perm.size * test_fraction + 0.5))
        train, test = np.sort(perm[n_test:]), np.sort(perm[:n_test])
    return ClientSplit(train.astype(np.int64), test.astype(np.int64))


def sites_partition(
    splits: Sequence[ClientSplit], sizes: Sequence[int], seed: int, task: str | None = None
) -> Partition:
    """The run's record of sites with their own data: client k's rows are site k's, its
    indices offset by the sizes of the sites before it (the sites' rows concatenated in client
    order, as the simulation holds them); `splits` are each site's own `site_split`."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))])
    clients = [ClientSplit(s.train + offsets[k], s.test + offsets[k])
               for k, s in enumerate(splits)]  # fmt: skip
    return Partition(clients=clients, scheme=SITES, num_clients=len(clients), seed=int(seed),
                     num_examples=int(offsets[-1]), task=task)  # fmt: skip


def client_shares(split: ClientSplit, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[C] one client's label shares as drawn (train and test together), rounded as
    partition.json records them."""
    counts = np.bincount(np.asarray(labels).astype(np.int64)[split.all], minlength=num_classes)
    return np.round(counts / max(int(counts.sum()), 1), 6)


def realised_shares(partition: Partition, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """[K, C] each client's label shares as drawn (`client_shares`)."""
    return np.stack([client_shares(c, labels, num_classes) for c in partition.clients])


def save_partition(
    partition: Partition,
    path: str | os.PathLike,
    labels: np.ndarray | None = None,
    realised: Sequence[Sequence[float]] | None = None,
    label_names: Sequence[str] | None = None,
) -> Path:
    """Write the partition as JSON (exact indices + parameters), atomically. With the pool's
    class `labels` (or each client's `client_shares`, `realised`, where the labels are
    elsewhere), each client's realised label shares go beside the target shares (for sites with
    their own data, whose label shares nobody drew: beside their counts); `label_names` name
    the shares' columns, so that a person reads "fresh", not column 1."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = partition.target_shares
    # the shares' columns: the target's, or a site's classes (their names; none for scores)
    num_classes = target.shape[1] if target is not None else (
        len(label_names) if partition.scheme == SITES and label_names else None)  # fmt: skip
    if num_classes is None:
        realised = None
    elif labels is not None:
        realised = realised_shares(partition, labels, num_classes).tolist()
    elif realised is not None:
        realised = [[float(x) for x in row] for row in realised]
    doc = {
        "format": _FORMAT,
        "scheme": partition.scheme,
        "num_clients": partition.num_clients,
        "seed": partition.seed,
        "num_examples": partition.num_examples,
        "alpha": partition.alpha,
        "beta": partition.beta,
        "task": partition.task,
        "test_fraction": partition.test_fraction,
        "fill": partition.fill,
        "dropped": partition.dropped,
        "target_shares": None if target is None else np.round(target, 6).tolist(),
        "realised_shares": realised,
        "label_names": None if label_names is None else [str(n) for n in label_names],
        "clients": [
            {"train": c.train.tolist(), "test": c.test.tolist()} for c in partition.clients
        ],
    }

    return atomic.write_text(path, json.dumps(doc))


def load_partition(path: str | os.PathLike) -> Partition:
    """Reads a `save_partition` file; UserError if missing, corrupt or overlapping."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != _FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        clients = [
            ClientSplit(np.asarray(c["train"], np.int64), np.asarray(c["test"], np.int64))
            for c in doc["clients"]
        ]
        target = doc["target_shares"]
        partition = Partition(
            clients=clients,
            scheme=doc["scheme"],
            num_clients=len(clients),
            seed=int(doc["seed"]),
            num_examples=int(doc["num_examples"]),
            alpha=doc["alpha"],
            beta=doc["beta"],
            task=doc["task"],
            test_fraction=float(doc["test_fraction"]),
            fill=doc["fill"],
            target_shares=None if target is None else np.asarray(target, np.float64),
            dropped=int(doc["dropped"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot read partition file {path}: {e}; rewrite it with save_partition"
        ) from None
    every = np.concatenate([np.concatenate([c.train, c.test]) for c in clients])
    n = partition.num_examples
    if every.size != np.unique(every).size or (
        every.size and (every.min() < 0 or every.max() >= n)
    ):
        raise UserError(f"partition file {path} has repeated or out-of-range example indices")
    return partition


def partition_report(
    partition: Partition, labels: np.ndarray, label_names: Sequence[str] | None = None
) -> str:
    """A printable table: per client train/test sizes and label counts (or score ranges)."""
    labels = np.asarray(labels)
    regression = np.issubdtype(labels.dtype, np.floating) and not (
        label_names is not None and len(label_names) > 0
    )
    head = (
        f"partition {partition.scheme} K={partition.num_clients} seed={partition.seed}"
        + (f" alpha={partition.alpha}" if partition.alpha is not None else "")
        + (f" beta={partition.beta}" if partition.beta is not None else "")
        + (f" task={partition.task}" if partition.task else "")
        + (f" fill={partition.fill}" if partition.fill else "")
        + f" examples={partition.num_examples}"
        + (f" ({partition.dropped} left out to hold every client's shares)"
           if partition.dropped else "")
    )  # fmt: skip
    if regression:
        cols = ["client", "train", "test", "min", "mean", "max"]
        rows = []
        for j, c in enumerate(partition.clients):
            y = labels[c.all].astype(np.float64)
            rows.append([str(j), str(c.train.size), str(c.test.size),
                         f"{y.min():.2f}", f"{y.mean():.2f}", f"{y.max():.2f}"])  # fmt: skip
    else:
        ids = labels.astype(np.int64)
        num_classes = int(max(ids.max() + 1, len(label_names or ())))
        names = list(label_names) if label_names else [str(c) for c in range(num_classes)]
        cols = ["client", "train", "test", *names]
        rows = []
        target = partition.target_shares
        for j, c in enumerate(partition.clients):
            counts = np.bincount(ids[c.all], minlength=num_classes)
            total = max(int(counts.sum()), 1)
            cells = [
                f"{n} ({100 * n / total:.0f}%"
                + (f", target {100 * target[j, i]:.0f}%)" if target is not None else ")")
                if num_classes <= 6
                else str(n)
                for i, n in enumerate(counts)
            ]
            rows.append([str(j), str(c.train.size), str(c.test.size), *cells])
    widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
    lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)

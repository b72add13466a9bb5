"""A task's example pool, and the checks every loader's rows pass on their way into one.

Rows are validated, never silently dropped: missing or out-of-range labels and empty texts raise
one UserError naming the task and the first offending rows (`checked_examples`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.tasks.registry import Task


@dataclasses.dataclass(frozen=True)
class Examples:
    """A task's example pool. `groups`: per-example origin (MNLI), `splits`: source split."""

    texts_a: list[str]
    texts_b: list[str] | None
    labels: np.ndarray  # int64 class ids, or float32 scores for regression
    groups: np.ndarray | None = None
    splits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.texts_a)

    def fingerprint(self) -> str:
        """sha256 of texts and labels: identifies the data for caches."""
        h = hashlib.sha256()
        for texts in (self.texts_a, self.texts_b or []):
            for t in texts:
                b = t.encode("utf-8")
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
            h.update(b"|")
        h.update(np.ascontiguousarray(self.labels).tobytes())
        h.update(str(self.labels.dtype).encode())
        return h.hexdigest()


def checked_examples(
    task: Task,
    texts: list[list[Any]],
    raw_labels: list[Any],
    where: list[str],
    groups: list[str | None] | None = None,
    splits: list[str] | None = None,
) -> Examples:
    """The pool of `texts` (one column per text field) and `raw_labels`, labels parsed and every
    row checked; one UserError naming the first bad rows by `where` (file:line)."""
    bad: list[str] = []
    labels = np.zeros(len(raw_labels), dtype=np.float32 if task.is_regression else np.int64)
    lookup = {name: i for i, name in enumerate(task.label_names)}
    for i, raw in enumerate(raw_labels):
        value = _parse_label(task, raw, lookup)
        if value is None:
            text = raw if isinstance(raw, str) else repr(raw)
            text = text if len(text) <= 20 else f"{text[:20]}..."
            shown = repr(text) if isinstance(raw, str) else text
            bad.append(f"{where[i]} (label {shown})")  # a site's error reaches the server
        else:
            labels[i] = value
        for field, column in zip(task.text_fields, texts, strict=True):
            t = column[i]
            if not isinstance(t, str) or not t.strip():
                bad.append(f"{where[i]} (empty {field})")
    if bad:
        raise UserError(
            f"task {task.name}: {len(bad)} invalid rows, e.g. {'; '.join(bad[:5])}; fix or remove "
            "them in the source data (labels must be "
            + ("finite scores" if task.is_regression else _label_space(task))
            + ", texts non-empty)"
        )
    return Examples(
        texts_a=list(texts[0]),
        texts_b=list(texts[1]) if len(texts) > 1 else None,
        labels=labels,
        groups=None if groups is None else np.asarray(groups),
        splits=None if splits is None else np.asarray(splits),
    )


def _label_space(task: Task) -> str:
    names = list(task.label_names)
    shown = names if len(names) <= 6 else [*names[:3], "...", names[-1]]
    return f"one of {shown} or an id 0..{task.num_labels - 1}"


def _parse_label(task: Task, raw: Any, lookup: dict[str, int]) -> float | int | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.strip()
        if raw in lookup:
            return lookup[raw]
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    if not np.isfinite(value):
        return None
    if task.is_regression:
        return value
    if value != int(value) or not 0 <= value < task.num_labels:
        return None
    return int(value)

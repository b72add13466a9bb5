"""Evaluation metrics of GLUE and the offline corpora, in plain numpy (no sklearn, no scipy).

Conventions follow the references GLUE results are usually computed with: Matthews correlation
and F1 are 0.0 when undefined (sklearn's `zero_division=0`), Pearson and Spearman are NaN when an
input is constant (scipy). Sums are taken in float64 so results do not depend on input dtype.
"""

from __future__ import annotations

import numpy as np


def _pair(predictions: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(predictions).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"predictions ({p.shape[0]}) and labels ({y.shape[0]}) differ in length")
    if p.size == 0:
        raise ValueError("metrics need at least one example")
    return p, y


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Fraction of predictions equal to the label."""
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def f1(predictions: np.ndarray, labels: np.ndarray, positive: int = 1) -> float:
    """Binary F1 of class `positive`: 2TP / (2TP + FP + FN); 0.0 when no positive exists at all."""
    p, y = _pair(predictions, labels)
    tp = int(np.sum((p == positive) & (y == positive)))
    fp = int(np.sum((p == positive) & (y != positive)))
    fn = int(np.sum((p != positive) & (y == positive)))
    denominator = 2 * tp + fp + fn
    return 0.0 if denominator == 0 else 2 * tp / denominator


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Matthews correlation (Gorodkin's multi-class form; the usual MCC for two classes).

    0.0 when either the predictions or the labels hold a single class (denominator zero).
    """
    p, y = _pair(predictions, labels)
    classes, inverse = np.unique(np.concatenate([p, y]), return_inverse=True)
    pi, yi = inverse[: p.size], inverse[p.size :]
    num_classes = classes.size
    t_k = np.bincount(yi, minlength=num_classes).astype(np.float64)
    p_k = np.bincount(pi, minlength=num_classes).astype(np.float64)
    correct = float(np.sum(pi == yi))
    s = float(p.size)
    cov_yp = correct * s - float(np.dot(t_k, p_k))
    cov_pp = s * s - float(np.dot(p_k, p_k))
    cov_yy = s * s - float(np.dot(t_k, t_k))
    if cov_pp == 0.0 or cov_yy == 0.0:
        return 0.0
    return float(cov_yp / np.sqrt(cov_pp * cov_yy))


def pearson(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation in float64; NaN when either input is constant."""
    p, y = _pair(predictions, labels)
    p = p.astype(np.float64)
    y = y.astype(np.float64)
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(y))):
        raise ValueError("pearson: inputs must be finite")
    dp = p - p.mean()
    dy = y - y.mean()
    denominator = np.sqrt(np.dot(dp, dp) * np.dot(dy, dy))
    if denominator == 0.0:
        return float("nan")
    return float(np.clip(np.dot(dp, dy) / denominator, -1.0, 1.0))


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given the mean of the ranks they span (scipy's rankdata 'average')."""
    x = np.asarray(x).reshape(-1)
    sorter = np.argsort(x, kind="mergesort")
    xs = x[sorter]
    starts = np.concatenate([[True], xs[1:] != xs[:-1]])
    dense = np.cumsum(starts)  # 1-based tie-group id in sorted order
    bounds = np.concatenate([np.flatnonzero(starts), [x.size]])
    # A group occupying sorted positions [a, b) gets ranks a+1..b, whose mean is (a + b + 1) / 2.
    sorted_ranks = 0.5 * (bounds[dense - 1] + bounds[dense] + 1)
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[sorter] = sorted_ranks
    return ranks


def spearman(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Spearman correlation: Pearson of average ranks; NaN when either input is constant."""
    p, y = _pair(predictions, labels)
    if not (np.all(np.isfinite(p)) and np.all(np.isfinite(y))):
        raise ValueError("spearman: inputs must be finite")
    return pearson(average_ranks(p), average_ranks(y))


METRICS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews_corrcoef": matthews_corrcoef,
    "pearson": pearson,
    "spearman": spearman,
}

"""Drawing clients' label shares and filling clients with them (FedNLP's non-IID schemes).

Dirichlet skew gives client j the class shares q_j ~ Dir(alpha * p), p the pool's class prior
(`dirichlet`; with beta, client sizes ~ Dir(beta * 1) too). Clients are filled in order 0..K-1,
sampling without replacement (`label_skew`, also the paper scheme's sequential fill); when a class
runs out, the vacancy is filled from the other classes in proportion to what remains ("dynamic
reassigning", FedNLP: `fill_counts`), so no example and no client is dropped, and a shortfall
lands on the later clients.
"""

from __future__ import annotations

import numpy as np


def round_to_total(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers proportional to `weights` summing to `total` (largest remainder)."""
    weights = np.asarray(weights, dtype=np.float64)
    if total == 0:
        return np.zeros(weights.shape, dtype=np.int64)
    raw = weights / weights.sum() * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        order = np.argsort(-(raw - counts), kind="stable")
        counts[order[:short]] += 1
    return counts


def fill_counts(want: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Per-class counts for one client: `want` capped by `remaining`, the shortfall re-spread.

    The shortfall goes to the classes that still have examples, in proportion to what they have
    left after this client's own take (FedNLP's dynamic reassigning).
    """
    take = np.minimum(want, remaining)
    deficit = int(want.sum() - take.sum())
    while deficit > 0:
        spare = remaining - take
        extra = np.minimum(round_to_total(spare, deficit), spare)
        take += extra
        deficit -= int(extra.sum())
    return take


def label_skew(
    class_ids: np.ndarray, shares: np.ndarray, sizes: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Assign examples to clients with class shares `shares` [K, C] and sizes `sizes` [K]."""
    num_classes = shares.shape[1]
    pools = [rng.permutation(np.flatnonzero(class_ids == c)) for c in range(num_classes)]
    used = np.zeros(num_classes, dtype=np.int64)
    remaining = np.array([p.size for p in pools], dtype=np.int64)
    out = []
    for k, size in enumerate(sizes):
        counts = fill_counts(round_to_total(shares[k], int(size)), remaining)
        parts = [pools[c][used[c] : used[c] + counts[c]] for c in range(num_classes)]
        used += counts
        remaining -= counts
        out.append(np.concatenate(parts))
    return out


def dirichlet(rng: np.random.Generator, concentration: np.ndarray, draws: int) -> np.ndarray:
    """Dirichlet draws that stay finite for tiny concentrations (all-zero gamma draws)."""
    q = rng.dirichlet(np.maximum(concentration, 1e-300), size=draws)
    bad = ~np.all(np.isfinite(q), axis=1) | (q.sum(axis=1) <= 0)
    for j in np.flatnonzero(bad):  # the limit alpha -> 0 of Dir(alpha p): one class, chosen by p
        q[j] = 0.0
        q[j, rng.choice(concentration.size, p=concentration / concentration.sum())] = 1.0
    return q

"""Fixed-point integers modulo 2^64 for secure aggregation: what a node masks, and the sum back.

Secure aggregation adds masked integers modulo 2^k, so a node's upload must be an integer vector.
What is quantised: the node's update of the global part as a flat fp32 vector (the wire image of
its trained global part cast to fp32, minus the copy it received; with the 16-bit wire both are
16-bit values), already clipped by the node, each coordinate clipped to [-c, c], multiplied by
the node's integer weight w (its example count for FedAvg; 1 under DP's uniform weights) and by
2^f, and rounded to the nearest integer (ties to even). Two integer fields follow, unscaled: the
weight w and an indicator 1[update norm <= clip] for adaptive DP clipping. The server's sum of n
such vectors gives sum_i w_i x_i, sum_i w_i and the unclipped count.

Every step is exact in float64 but the one rounding: x is fp32 (24-bit significand), w < 2^29
and c is an fp32 value, so x w has at most 53 significant bits, and 2^f is a power of two. Hence
the value is round(x w 2^f) on any machine, and the simulation reproduces it bit for bit.

Why k = 64: the sum of N nodes must not wrap. With |x| <= c and w <= W, one node's integer is at
most W c 2^f + 1/2, so N (W c 2^f + 1/2) <= 2^63 - 1 keeps the signed sum inside (-2^63, 2^63):
f is the largest integer for which this holds. The grid must be as fine as fp32 at the clip
(2^-f <= c 2^-24), so N W 2^24 + N/2 <= 2^63 - 1: N W up to about 2^39 (5.5e11). With k = 32 the
same resolution allows N W <= 2^7, too few for example weights, at half the bytes.

Error: each node's rounding is at most 2^-(f+1), so |dequantised sum - sum_i w_i x_i| <= n
2^-(f+1) <= n c 2^-25 for the exact sum of n nodes' clipped values (float64 adds at most one
relative 2^-53 more when |sum| > 2^53 2^-f). `error_bound` returns n 2^-(f+1).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from fedjax_split.errors import UserError

BITS = 64  # k: the masked vector's integers are modulo 2^64
EXTRA_FIELDS = 2  # the weight and the unclipped indicator, after the update's entries
_LIMIT = 2 ** (BITS - 1) - 1  # the largest |sum| the signed view recovers
_RESOLUTION_BITS = 24  # the grid at least as fine as fp32 at the clip: 2^-f <= c 2^-24
_MAX_WEIGHT = 2**29 - 1  # x (24 bits) times w stays exact in float64 (53 bits)


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    """The quantisation every node and the server agree on: the same spec, the same integers."""

    clip: float  # c: each coordinate of the update is clipped to [-c, c] (held as its fp32 value)
    max_weight: int  # W: the largest weight a node may carry (1 under DP)
    max_nodes: int  # N: the most nodes whose vectors are summed

    def __post_init__(self) -> None:
        c = float(np.float32(self.clip))
        if not (math.isfinite(c) and c > 0):
            raise UserError(f"the secure-aggregation clip must be positive, got {self.clip}")
        if not (isinstance(self.max_weight, int) and 1 <= self.max_weight <= _MAX_WEIGHT):
            raise UserError(
                f"the secure-aggregation maximum weight must be an integer in [1, {_MAX_WEIGHT}], "
                f"got {self.max_weight}"
            )
        if not (isinstance(self.max_nodes, int) and self.max_nodes >= 1):
            raise UserError(f"secure aggregation needs at least one node, got {self.max_nodes}")
        object.__setattr__(self, "clip", c)
        if Fraction(1, 1) / _power(self.frac_bits) > Fraction(c) / 2**_RESOLUTION_BITS:
            raise UserError(
                f"secure aggregation cannot sum {self.max_nodes} nodes of weight up to "
                f"{self.max_weight} in 64-bit integers at fp32's resolution (nodes x weight x "
                f"2^24 must stay below 2^63): lower the maximum weight or the number of nodes"
            )

    @property
    def frac_bits(self) -> int:
        """f: the largest integer with N (W c 2^f + 1/2) <= 2^63 - 1 (the module docstring)."""
        most = Fraction(self.max_weight) * Fraction(self.clip)
        room = (Fraction(_LIMIT) / self.max_nodes - Fraction(1, 2)) / most
        f = math.floor(math.log2(room))  # then exact: log2 of a Fraction may round either way
        while _power(f + 1) <= room:
            f += 1
        while _power(f) > room:
            f -= 1
        return f

    def length(self, entries: int) -> int:
        """The masked vector's length for a global part of `entries` values."""
        return entries + EXTRA_FIELDS


def _power(f: int) -> Fraction:
    return Fraction(2) ** f


def quantise(update: np.ndarray, weight: int, unclipped: bool, spec: FixedPoint) -> np.ndarray:
    """One node's integers modulo 2^64 (uint64): round(clip(x, -c, c) w 2^f), then w and
    1[unclipped]. `update` is the flat fp32 update of the global part, finite."""
    x = np.asarray(update)
    if x.dtype != np.float32 or x.ndim != 1:
        raise ValueError(f"quantise takes a flat float32 vector, got {x.dtype} of shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("quantise: the update has non-finite values; leave this node out")
    if isinstance(weight, bool) or int(weight) != weight or not 0 <= weight <= spec.max_weight:
        raise ValueError(f"quantise: weight {weight} is not an integer in [0, {spec.max_weight}]")
    scaled = np.clip(x.astype(np.float64), -spec.clip, spec.clip) * float(weight)
    values = np.rint(scaled * math.ldexp(1.0, spec.frac_bits)).astype(np.int64)
    extras = np.array([int(weight), int(bool(unclipped))], np.int64)
    return np.concatenate([values, extras]).view(np.uint64)


def add(total: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """total + vector modulo 2^64 (uint64 wraps): how the simulation sums quantised vectors."""
    return np.add(total, vector, dtype=np.uint64)


def sum_quantised(vectors: list[np.ndarray]) -> np.ndarray:
    """The sum modulo 2^64 of quantised vectors, in their order (the order does not matter)."""
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = add(total, v)
    return total


class Dequantised(NamedTuple):
    weighted_sum: np.ndarray  # sum_i w_i x_i, float64 (to within `error_bound`)
    weight: int  # sum_i w_i
    unclipped: int  # how many nodes' updates were within the clip norm


def dequantise(total: np.ndarray, spec: FixedPoint) -> Dequantised:
    """The sums back from a sum modulo 2^64 of at most N quantised vectors."""
    t = np.asarray(total)
    if t.dtype != np.uint64 or t.ndim != 1 or t.shape[0] < EXTRA_FIELDS:
        raise ValueError(f"dequantise takes a flat uint64 sum, got {t.dtype} of shape {t.shape}")
    signed = t.view(np.int64)
    values = signed[:-EXTRA_FIELDS].astype(np.float64) * math.ldexp(1.0, -spec.frac_bits)
    return Dequantised(values, int(signed[-2]), int(signed[-1]))


def error_bound(spec: FixedPoint, nodes: int) -> float:
    """The most the dequantised sum of `nodes` vectors can differ from sum_i w_i clip(x_i):
    half a step per node."""
    return nodes * math.ldexp(1.0, -spec.frac_bits - 1)

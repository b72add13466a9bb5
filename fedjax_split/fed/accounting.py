"""Privacy accounting for client-level DP-FedAvg, by Google's dp_accounting.

Each round adds Gaussian noise of std z * C to the sum of client updates clipped to norm C, over a
Poisson sample of the clients (each independently with probability q); neighbouring datasets
differ by adding or removing one client's whole data. The (epsilon, delta) guarantee after R rounds
is dp_accounting's (RDP or PLD accountant) for that event. With adaptive clipping a round releases
two Gaussians, the updates' sum (noise z_delta C) and the centred count of unclipped clients
(sensitivity 1/2, noise sigma_b: `fed.privacy`); one client moves the pair, in units of each noise,
by at most sqrt(z_delta^-2 + (2 sigma_b)^-2) = 1 / z, so the round is exactly one Gaussian of
multiplier z, sampled or not, and the accountant is told z. The accountant is the library's only
source of privacy numbers, so none of its mathematics is repeated here. dp_accounting is imported
inside the functions, so importing this module loads nothing heavy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

from fedjax_split.errors import UserError

if TYPE_CHECKING:
    import dp_accounting

ACCOUNTANTS = ("rdp", "pld")
ADJACENCY = "add or remove one client"


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """One round's mechanism: Gaussian noise of std noise_multiplier * C on the sum of updates
    clipped to norm C, clients Poisson-sampled at sampling_rate (1.0: every client every round,
    so no amplification by sampling); `accountant` is "rdp" or "pld"."""

    noise_multiplier: float
    sampling_rate: float
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        z, q = self.noise_multiplier, self.sampling_rate
        if not (math.isfinite(z) and z > 0):
            raise UserError(f"--dp-noise-multiplier must be a positive number, got {z}")
        if not (math.isfinite(q) and 0 < q <= 1):
            raise UserError(
                f"the client sampling rate must be in (0, 1], got {q}: set --clients-per-round "
                "between 1 and the number of clients"
            )
        if self.accountant not in ACCOUNTANTS:
            raise UserError(
                f"unknown privacy accountant {self.accountant!r}: --dp-accountant takes "
                + " or ".join(ACCOUNTANTS)
            )


def dp_event(mech: Mechanism, rounds: int) -> dp_accounting.DpEvent:
    """The DpEvent of `rounds` rounds: a self-composed Gaussian, Poisson-sampled when q < 1."""
    import dp_accounting

    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")
    if rounds == 0:
        return dp_accounting.NoOpDpEvent()
    event: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(mech.noise_multiplier)
    if mech.sampling_rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(mech.sampling_rate, event)
    return dp_accounting.SelfComposedDpEvent(event, rounds)


def _check_delta(delta: float) -> None:
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise UserError(f"--dp-delta must be in (0, 1), e.g. 1e-5, got {delta}")


def _accountant(name: str) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant under add-or-remove-one-client adjacency (the relation DP-FedAvg's
    Poisson sampling is analysed under)."""
    import dp_accounting

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if name == "pld":
        return dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)


def epsilon(mech: Mechanism, rounds: int, delta: float) -> float:
    """The epsilon of `rounds` rounds at `delta`, by the mechanism's accountant; 0.0 for none."""
    _check_delta(delta)
    if rounds == 0:
        return 0.0
    accountant = _accountant(mech.accountant)
    # RDP leaves out the orders its series does not converge at (a logged warning each, dozens a
    # call): the epsilon from the other orders is still a valid bound, so those lines are muted
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(dp_event(mech, rounds))
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def rounds_within(mech: Mechanism, delta: float, max_epsilon: float, limit: int) -> int:
    """The most rounds R <= limit with epsilon(R) <= max_epsilon (0 if one round exceeds it).

    Epsilon does not decrease with R, so doubling R until it leaves the budget (or reaches the
    limit) and then bisecting finds R with O(log R) calls of the accountant; never asking about
    far more rounds than the budget allows matters for PLD, whose cost grows with epsilon."""
    _check_delta(delta)
    if not max_epsilon >= 0:
        raise UserError(f"the privacy budget epsilon must be >= 0, got {max_epsilon}")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    within, over = 0, 1  # epsilon(within) <= max_epsilon; over: the next guess
    while True:
        over = min(over, limit)
        if over == within:
            return limit
        if epsilon(mech, over, delta) > max_epsilon:
            break
        within, over = over, 2 * over
    while over - within > 1:  # epsilon(within) <= max_epsilon < epsilon(over)
        mid = (within + over) // 2
        if epsilon(mech, mid, delta) <= max_epsilon:
            within = mid
        else:
            over = mid
    return within


def describe(mech: Mechanism, delta: float, clip_norm: float | None = None) -> str:
    """One line for a person: the mechanism, the sampling, the adjacency and the accountant."""
    norm = "C" if clip_norm is None else f"{clip_norm:g}"
    if mech.sampling_rate < 1:
        sampling = f"clients Poisson-sampled at rate {mech.sampling_rate:g}"
    else:
        sampling = "every client every round (no amplification by sampling)"
    return (
        f"client-level DP: Gaussian noise z = {mech.noise_multiplier:g} on the sum of updates "
        f"clipped to norm {norm}, {sampling}; adjacency: adding or removing one client; "
        f"{mech.accountant.upper()} accountant, delta = {delta:g}"
    )


def as_dict(mech: Mechanism, delta: float) -> dict[str, Any]:
    """The mechanism and accounting settings, for summary.json."""
    return {
        "mechanism": "gaussian",
        "noise_multiplier": float(mech.noise_multiplier),
        "sampling": "poisson" if mech.sampling_rate < 1 else "all clients",
        "sampling_rate": float(mech.sampling_rate),
        "adjacency": ADJACENCY,
        "accountant": mech.accountant,
        "delta": float(delta),
    }

"""Tests for client-level DP accounting: the module's epsilon is dp_accounting's, agrees with the
analytic Gaussian mechanism where composition is exact, and behaves as a privacy budget must."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest
from fedcore_helpers import dp_reference_epsilon
from scipy.optimize import brentq
from scipy.stats import norm

from fedjax_split.errors import UserError
from fedjax_split.fed import accounting
from fedjax_split.fed.accounting import Mechanism
from fedjax_split.fed.privacy import DPSpec


def _analytic_gaussian_epsilon(s: float, delta: float) -> float:
    """Balle & Wang (2018), Theorem 8: the exact epsilon of one Gaussian of std s at sensitivity 1
    under add/remove adjacency, solved from delta(eps)."""

    def gap(eps: float) -> float:
        return (norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s))
                - delta)  # fmt: skip

    return brentq(gap, 0.0, 500.0, xtol=1e-12)


@pytest.mark.parametrize("name", ["rdp", "pld"])
@pytest.mark.parametrize(
    ("z", "q", "rounds", "delta"),
    [(1.1, 0.05, 100, 1e-5), (0.8, 0.01, 300, 1e-6), (2.0, 1.0, 5, 1e-5), (1.5, 0.3, 1, 1e-3)],
)
def test_epsilon_is_dp_accountings(z: float, q: float, rounds: int, delta: float,
                                   name: str) -> None:  # fmt: skip
    got = accounting.epsilon(Mechanism(z, q, name), rounds, delta)
    want = dp_reference_epsilon(z, q, rounds, delta, name)
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got < 100


@pytest.mark.parametrize(
    ("z", "rounds", "delta"), [(2.0, 4, 1e-5), (5.0, 10, 1e-5), (3.0, 1, 1e-6), (10.0, 50, 1e-3)]
)
def test_full_participation_matches_the_analytic_gaussian(z: float, rounds: int,
                                                          delta: float) -> None:  # fmt: skip
    # R Gaussian rounds of multiplier z compose exactly to one Gaussian of multiplier z / sqrt(R).
    exact = _analytic_gaussian_epsilon(z / math.sqrt(rounds), delta)
    pld = accounting.epsilon(Mechanism(z, 1.0, "pld"), rounds, delta)
    rdp = accounting.epsilon(Mechanism(z, 1.0, "rdp"), rounds, delta)
    assert pld == pytest.approx(exact, rel=1e-4)
    assert exact <= rdp <= 1.25 * exact  # RDP's conversion to (eps, delta) is an upper bound


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_epsilon_grows_with_rounds_and_shrinks_with_noise(name: str) -> None:
    eps = [accounting.epsilon(Mechanism(1.1, 0.05, name), r, 1e-5) for r in (0, 1, 10, 100)]
    assert eps[0] == 0.0
    assert all(a < b for a, b in zip(eps, eps[1:], strict=False))
    by_z = [accounting.epsilon(Mechanism(z, 0.05, name), 50, 1e-5) for z in (0.7, 1.0, 2.0)]
    assert all(a > b for a, b in zip(by_z, by_z[1:], strict=False))


@pytest.mark.parametrize("name", ["rdp", "pld"])
def test_sampling_amplifies(name: str) -> None:
    everyone = accounting.epsilon(Mechanism(3.0, 1.0, name), 20, 1e-5)
    sampled = accounting.epsilon(Mechanism(3.0, 0.1, name), 20, 1e-5)
    assert sampled < 0.5 * everyone


def test_dp_event_structure() -> None:
    assert accounting.dp_event(Mechanism(1.0, 0.5), 0) == dp_accounting.NoOpDpEvent()
    full = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 7)
    assert accounting.dp_event(Mechanism(1.0, 1.0), 7) == full
    sampled = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(1.0)), 7)
    assert accounting.dp_event(Mechanism(1.0, 0.5), 7) == sampled


@pytest.mark.parametrize(
    ("name", "z", "q", "budget"),
    [("rdp", 1.1, 0.05, 3.0), ("rdp", 5.0, 1.0, 2.0), ("pld", 2.0, 1.0, 4.0)],
)
def test_rounds_within_is_the_last_round_inside_the_budget(name: str, z: float, q: float,
                                                           budget: float) -> None:  # fmt: skip
    mech = Mechanism(z, q, name)
    r = accounting.rounds_within(mech, 1e-5, budget, limit=10_000)
    assert 0 < r < 10_000
    assert accounting.epsilon(mech, r, 1e-5) <= budget < accounting.epsilon(mech, r + 1, 1e-5)


def test_rounds_within_respects_the_limit_and_a_tight_budget() -> None:
    mech = Mechanism(1.1, 0.05)
    assert accounting.rounds_within(mech, 1e-5, 3.0, limit=20) == 20
    assert accounting.rounds_within(mech, 1e-5, 3.0, limit=0) == 0
    one = accounting.epsilon(mech, 1, 1e-5)
    assert accounting.rounds_within(mech, 1e-5, 0.5 * one, limit=100) == 0
    assert accounting.rounds_within(mech, 1e-5, one, limit=100) >= 1


def test_rounds_within_asks_only_about_rounds_near_the_answer(monkeypatch) -> None:
    # PLD's cost grows with epsilon: a huge limit must not be evaluated when the budget ends early.
    asked: list[int] = []
    real = accounting.epsilon

    def counting(mech: Mechanism, rounds: int, delta: float) -> float:
        asked.append(rounds)
        return real(mech, rounds, delta)

    monkeypatch.setattr(accounting, "epsilon", counting)
    r = accounting.rounds_within(Mechanism(5.0, 1.0), 1e-5, 2.0, limit=10**9)
    assert 0 < r and max(asked) <= 2 * (r + 1)
    assert len(asked) <= 2 * math.log2(r + 1) + 2


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda: Mechanism(0.0, 0.1), "--dp-noise-multiplier"),
        (lambda: Mechanism(-1.0, 0.1), "--dp-noise-multiplier"),
        (lambda: Mechanism(float("nan"), 0.1), "--dp-noise-multiplier"),
        (lambda: Mechanism(1.0, 0.0), "--clients-per-round"),
        (lambda: Mechanism(1.0, 1.5), "--clients-per-round"),
        (lambda: Mechanism(1.0, 0.1, "moments"), "--dp-accountant"),
        (lambda: accounting.epsilon(Mechanism(1.0, 0.1), 10, 0.0), "--dp-delta"),
        (lambda: accounting.epsilon(Mechanism(1.0, 0.1), 10, 1.0), "--dp-delta"),
        (lambda: accounting.rounds_within(Mechanism(1.0, 0.1), 2.0, 1.0, 10), "--dp-delta"),
    ],
)
def test_bad_input_is_a_one_line_user_error(make, flag: str) -> None:
    with pytest.raises(UserError) as info:
        make()
    message = str(info.value)
    assert flag in message
    assert "\n" not in message


def test_describe_and_as_dict() -> None:
    sampled, everyone = Mechanism(1.1, 0.05), Mechanism(1.1, 1.0, "pld")
    line = accounting.describe(sampled, 1e-5)
    assert "\n" not in line
    for part in ("z = 1.1", "Poisson-sampled at rate 0.05", "adding or removing one client",
                 "RDP accountant", "delta = 1e-05"):  # fmt: skip
        assert part in line
    full = accounting.describe(everyone, 1e-5, clip_norm=0.5)
    assert "every client every round" in full and "norm 0.5" in full and "PLD" in full
    assert accounting.as_dict(sampled, 1e-5) == {
        "mechanism": "gaussian", "noise_multiplier": 1.1, "sampling": "poisson",
        "sampling_rate": 0.05, "adjacency": "add or remove one client", "accountant": "rdp",
        "delta": 1e-5,
    }  # fmt: skip
    assert accounting.as_dict(everyone, 1e-5)["sampling"] == "all clients"
    json.dumps(accounting.as_dict(everyone, 1e-5))


def test_importing_the_module_loads_no_accountant() -> None:
    code = "import sys, fedjax_split.fed.accounting\nprint('dp_accounting' in sys.modules)\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


# Adaptive clipping (fed/privacy.py): a round releases two Gaussians, the clipped updates' sum
# (sensitivity C, noise z_delta C) and the centred count of unclipped clients (sensitivity 1/2,
# tests/test_privacy.py checks it by hand; noise sigma_b), while the accountant is told z alone.


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _round_event(spec: DPSpec, count_sensitivity: float, q: float) -> dp_accounting.DpEvent:
    """One round of adaptive clipping as two Gaussians, each as a multiplier over its own
    sensitivity, Poisson-sampled as one when q < 1 (a client is in both or in neither)."""
    event: dp_accounting.DpEvent = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(float(spec.update_noise_multiplier)),
        dp_accounting.GaussianDpEvent(float(spec.sigma_b / count_sensitivity)),
    ])  # fmt: skip
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    return event


@pytest.mark.parametrize(
    ("m", "z", "q", "rounds", "delta", "count_stddev"),
    [
        (20, 1.0, 0.2, 6, 1e-3, None),  # tools/privacy_study.py's DP setting
        (100, 0.8, 0.05, 50, 1e-5, None),
        (40, 1.2, 1.0, 10, 1e-5, None),  # every client every round
        (10, 0.3, 0.3, 3, 1e-5, None),
        (5, 1.0, 0.5, 8, 1e-5, 4.0),  # an explicit count noise
    ],
)  # fmt: skip
def test_adaptive_clippings_two_gaussians_cost_the_epsilon_reported(
    m: int, z: float, q: float, rounds: int, delta: float, count_stddev: float | None
) -> None:
    spec = DPSpec(clip=1.0, noise_multiplier=z, denominator=float(m), target_quantile=0.5,
                  count_stddev=count_stddev)  # fmt: skip
    reported = accounting.epsilon(Mechanism(z, q), rounds, delta)
    # dp_accounting's RDP accepts a Poisson-sampled composition of Gaussians
    want = _rdp_epsilon(dp_accounting.SelfComposedDpEvent(_round_event(spec, 0.5, q), rounds),
                        delta)  # fmt: skip
    assert reported == pytest.approx(want, rel=1e-9)
    # the updates' share alone would cost less: the count's noise takes part of the budget
    alone = accounting.epsilon(Mechanism(spec.update_noise_multiplier, q), rounds, delta)
    assert alone < reported
    if q == 1:
        # PLD composes the two Gaussians too (it takes no Poisson sample of a composition; there
        # the pair is still exactly one Gaussian of multiplier z: the noise scaled to 1 in each
        # coordinate, one client moves the pair by a vector of norm at most
        # sqrt(z_delta^-2 + (2 sigma_b)^-2) = 1 / z, so RDP's check above covers q < 1)
        relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        pld = dp_accounting.pld.PLDAccountant(neighboring_relation=relation)
        pld.compose(dp_accounting.SelfComposedDpEvent(_round_event(spec, 0.5, q), rounds))
        got = accounting.epsilon(Mechanism(z, q, "pld"), rounds, delta)
        assert got == pytest.approx(pld.get_epsilon(delta), rel=1e-6)


def test_an_uncentred_count_would_cost_more_than_the_epsilon_reported() -> None:
    """The defect the centred count fixes: a count of unclipped clients moves by 1 per client,
    so with z_delta split off for a sensitivity of 1/2 the round is one Gaussian of multiplier
    (z_delta^-2 + sigma_b^-2)^-1/2 < z, and the run would spend more than it reports."""
    m, z, q, rounds, delta = 20, 1.0, 0.2, 6, 1e-3  # tools/privacy_study.py's DP setting
    spec = DPSpec(clip=1.0, noise_multiplier=z, denominator=float(m), target_quantile=0.5)
    assert spec.sigma_b == 1.0
    z_delta = (1 / z**2 - 1 / (2 * spec.sigma_b) ** 2) ** -0.5  # by hand: (1 - 1/4)^-1/2
    assert spec.update_noise_multiplier == pytest.approx(z_delta, rel=1e-12)
    reported = accounting.epsilon(Mechanism(z, q), rounds, delta)
    centred = _rdp_epsilon(dp_accounting.SelfComposedDpEvent(_round_event(spec, 0.5, q), rounds),
                           delta)  # fmt: skip
    uncentred = _rdp_epsilon(
        dp_accounting.SelfComposedDpEvent(_round_event(spec, 1.0, q), rounds), delta
    )
    z_uncentred = (z_delta**-2 + spec.sigma_b**-2) ** -0.5  # sqrt(4/7) = 0.756
    assert z_uncentred == pytest.approx(math.sqrt(4 / 7), rel=1e-12)
    single = dp_reference_epsilon(z_uncentred, q, rounds, delta)
    assert uncentred == pytest.approx(single, rel=1e-9)
    assert reported == pytest.approx(centred, rel=1e-9)
    # the numbers docs/privacy.md quotes, as dp_accounting gives them above
    assert round(reported, 2) == 3.12 and round(uncentred, 2) == 5.30
    assert uncentred > 1.6 * reported

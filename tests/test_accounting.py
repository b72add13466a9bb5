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

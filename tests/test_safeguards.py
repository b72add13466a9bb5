"""Tests for run/safeguards.py: what a config says of the server's safeguards. Client sampling
(exactly M of K; Poisson with DP), the attackers, epsilon against dp_accounting's own figure (the
events built here), the rounds a budget allows, and the lines and record fields a run writes."""

from __future__ import annotations

import hashlib
import hmac
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from fedcore_helpers import dp_reference_epsilon

from fedjax_split.fed import aggregation
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.strategy import RoundPlan
from fedjax_split.run import safeguards
from fedjax_split.run.config import resolve_config


def _config(**kw: object):
    return resolve_config(overrides={"clients": 10, **kw})


def _dp(**kw: object):
    """DP with a fixed clip norm, 10 clients, 2 a round (Poisson, q = 0.2)."""
    return _config(**{"clients_per_round": 2, "dp_noise_multiplier": 1.1, "dp_clip": 0.5, **kw})


def test_without_dp_a_round_takes_exactly_m_of_k() -> None:
    config = _config(clients_per_round=3, seed=4)
    seen = set()
    for r in range(1, 40):
        ids = safeguards.sample(config, r)
        assert len(ids) == 3 == len(set(ids.tolist())) and ids.tolist() == sorted(ids.tolist())
        assert 0 <= ids.min() and ids.max() < 10
        seen.add(tuple(ids.tolist()))
    assert len(seen) > 20  # a new draw each round
    everyone = _config(seed=4)  # --clients-per-round all
    assert safeguards.sample(everyone, 7).tolist() == list(range(10))


def test_dp_with_every_client_samples_every_client() -> None:
    config = _config(dp_noise_multiplier=1.0, dp_clip=1.0)  # M = K: no Poisson sampling
    assert not config.poisson_sampling
    for r in (1, 2, 9):
        assert safeguards.sample(config, r).tolist() == list(range(10))


def test_dp_with_fewer_clients_a_round_samples_each_client_independently() -> None:
    config = _config(clients=100, clients_per_round=10, dp_noise_multiplier=1.0, dp_clip=1.0,
                     seed=3)  # fmt: skip
    assert config.poisson_sampling
    secret = ServerSecret(bytes(range(32)))  # a fixed secret: the statistics below are exact
    draws = [safeguards.sample(config, r, secret) for r in range(1, 301)]
    sizes = np.array([len(d) for d in draws])
    # 30,000 Bernoulli(0.1) draws: the rate within 4 standard errors (0.0017) of 0.1
    assert abs(sizes.mean() / 100 - 0.1) < 0.007
    assert len(set(sizes.tolist())) > 5  # not M every round: the size varies
    assert sizes.std() == pytest.approx(np.sqrt(100 * 0.1 * 0.9), rel=0.2)
    counts = np.bincount(np.concatenate(draws), minlength=100)  # every client takes part
    assert counts.min() > 10 and counts.max() < 55  # binomial(300, 0.1): mean 30, sd 5.2
    for d in draws:
        assert d.tolist() == sorted(set(d.tolist()))
    # the same secret and round draw the same clients (a resumed run, whose checkpoint holds
    # the secret); another run of the same config, with its own secret, other ones
    np.testing.assert_array_equal(safeguards.sample(config, 17, secret), draws[16])
    again = ServerSecret.from_array(secret.to_array())
    np.testing.assert_array_equal(safeguards.sample(config, 17, again), draws[16])
    rerun = safeguards.server_secret(config)
    assert sum(np.array_equal(safeguards.sample(config, r, rerun), draws[r - 1])
               for r in range(1, 21)) <= 2  # fmt: skip
    # by hand: client i is in when HMAC-SHA256(secret, "sample" | r | i)'s first 53 bits, as a
    # fraction, are below the rate
    key = secret.to_array()[:-1].tobytes()
    fractions = [(int.from_bytes(hmac.new(key, b"sample" + struct.pack(">qq", 17, i),
                                         hashlib.sha256).digest()[:8], "big") >> 11) / 2.0**53
                 for i in range(100)]  # fmt: skip
    np.testing.assert_array_equal(draws[16], np.flatnonzero(np.asarray(fractions) < 0.1))


def test_the_poisson_sample_cannot_be_recomputed_from_the_seed() -> None:
    """config.json holds the seed: a sample drawn from it, as one was before, would tell anyone
    who took part. Each run's sample follows its own secret; only the opt-out follows the seed."""
    config = _config(clients=200, clients_per_round=20, dp_noise_multiplier=1.0, dp_clip=1.0,
                     seed=3)  # fmt: skip
    secret = safeguards.server_secret(config)
    assert not secret.reproducible
    for r in (1, 2, 3):
        from_seed = np.flatnonzero(np.random.default_rng([3, r, 1]).random(200) < 0.1)
        assert not np.array_equal(safeguards.sample(config, r, secret), from_seed)
    with pytest.raises(ValueError, match="secret"):
        safeguards.sample(config, 1)  # never a fallback to the seed
    insecure = resolve_config(overrides={**config.to_dict(),
                                         "dp_insecure_reproducible_noise": True})  # fmt: skip
    a, b = safeguards.server_secret(insecure), safeguards.server_secret(insecure)
    assert a.reproducible and a == b
    np.testing.assert_array_equal(safeguards.sample(insecure, 4, a),
                                  safeguards.sample(insecure, 4, b))  # fmt: skip


def test_poisson_sampling_may_draw_nobody() -> None:
    config = _config(clients=3, clients_per_round=1, dp_noise_multiplier=1.0, dp_clip=1.0)
    secret = ServerSecret(bytes(32))
    sizes = [len(safeguards.sample(config, r, secret)) for r in range(1, 60)]
    # each round is empty with probability (2/3)^3 = 0.3
    assert 0 in sizes and max(sizes) >= 2
    empty = safeguards.sample(config, sizes.index(0) + 1, secret)
    assert empty.shape == (0,) and empty.dtype == np.int32


def test_attackers_and_their_factors() -> None:
    assert safeguards.attackers(_config()).tolist() == []
    assert safeguards.attack_factors(_config(), np.arange(10)) is None
    config = _config(clients=20, attack="sign-flip", attack_fraction=0.1, seed=1)
    ids = safeguards.attackers(config)
    assert len(ids) == 2 and ids.tolist() == sorted(set(ids.tolist()))  # 0.1 of 20
    np.testing.assert_array_equal(safeguards.attackers(config), ids)  # the same every round
    # numpy's generator seeded with (seed, the attack's purpose 2) chooses them
    want = np.sort(np.random.default_rng([1, 2]).choice(20, size=2, replace=False))
    np.testing.assert_array_equal(ids, want)
    sampled = np.array(sorted({0, 5, 19, *ids.tolist()}))
    factors = safeguards.attack_factors(config, sampled)
    assert factors.dtype == np.float32 and factors.shape == sampled.shape
    np.testing.assert_array_equal(factors, np.where(np.isin(sampled, ids), -1.0, 1.0))
    assert (factors == -1).sum() == 2
    scale = _config(clients=20, attack="scale", attack_scale=30.0, attack_fraction=0.1, seed=1)
    np.testing.assert_array_equal(safeguards.attack_factors(scale, sampled),
                                  np.where(np.isin(sampled, ids), 30.0, 1.0))  # fmt: skip
    # a tiny fraction is still one attacker; a sample without them leaves every factor 1
    one = _config(attack="scale", attack_fraction=0.01)
    (attacker,) = safeguards.attackers(one).tolist()
    others = np.array([c for c in range(10) if c != attacker])
    assert safeguards.attack_factors(one, others).tolist() == [1.0] * 9
    assert safeguards.attack_factors(one, np.zeros(0, np.int32)).shape == (0,)


def test_aggregator_and_mechanism_from_the_config() -> None:
    assert safeguards.aggregator(_config()) == aggregation.Aggregator()
    assert safeguards.mechanism(_config()) is None
    agg = safeguards.aggregator(_config(aggregator="trimmed-mean", trim_fraction=0.3,
                                        max_update_norm=2.0))  # fmt: skip
    assert (agg.rule, agg.trim_fraction, agg.max_update_norm, agg.dp) == ("trimmed-mean", 0.3,
                                                                         2.0, None)  # fmt: skip
    config = _config(clients_per_round=4, dp_noise_multiplier=0.2, dp_clip=0.5,
                     dp_clip_quantile=0.6)  # fmt: skip
    dp = safeguards.aggregator(config).dp
    # the denominator is M, the expected clients a round; sigma_b = M / 20
    assert (dp.clip, dp.noise_multiplier, dp.denominator, dp.target_quantile) == (0.5, 0.2, 4.0,
                                                                                  0.6)  # fmt: skip
    assert dp.sigma_b == pytest.approx(0.2)
    mech = safeguards.mechanism(config)
    assert (mech.noise_multiplier, mech.sampling_rate, mech.accountant) == (0.2, 0.4, "rdp")
    assert safeguards.mechanism(_config(dp_noise_multiplier=0.0, dp_clip=1.0)) is None


@pytest.mark.parametrize(
    ("kw", "z", "q"),
    [
        ({}, 1.1, 0.2),  # Poisson-sampled at M / K
        ({"clients_per_round": None}, 1.1, 1.0),  # every client: no amplification
        ({"dp_accountant": "pld", "dp_noise_multiplier": 2.0}, 2.0, 0.2),
    ],
)
def test_epsilon_is_dp_accountings_own(kw: dict, z: float, q: float) -> None:
    config = _dp(dp_delta=1e-4, **kw)
    for r in (1, 5, 40):
        want = dp_reference_epsilon(z, q, r, 1e-4, config.privacy.dp_accountant)
        assert safeguards.epsilon(config, r) == pytest.approx(want, rel=1e-9)
    assert safeguards.epsilon(config, 0) == 0.0
    assert safeguards.epsilon(_config(), 5) is None  # no DP
    assert safeguards.epsilon(_dp(dp_noise_multiplier=0.0), 5) is None  # no noise


def test_rounds_allowed_stops_before_the_budget_is_exceeded() -> None:
    budget = 8.0  # one round spends 2.4 (z = 1.1, q = 0.2, delta 1e-5)
    config = _dp(rounds=1000, dp_max_epsilon=budget)
    allowed = safeguards.rounds_allowed(config)
    assert 1 < allowed < 1000
    eps = [dp_reference_epsilon(1.1, 0.2, r, 1e-5) for r in (allowed, allowed + 1)]
    assert eps[0] <= budget < eps[1]
    # --rounds is the limit; without a budget (or without DP) it is the answer
    assert safeguards.rounds_allowed(_dp(rounds=3, dp_max_epsilon=budget)) == 3
    assert safeguards.rounds_allowed(_dp(rounds=1000)) == 1000
    assert safeguards.rounds_allowed(_config(rounds=7)) == 7
    # a budget below one round's epsilon allows none
    tight = _dp(rounds=10, dp_max_epsilon=0.5 * dp_reference_epsilon(1.1, 0.2, 1, 1e-5))
    assert safeguards.rounds_allowed(tight) == 0


def test_line_names_the_mechanism_and_the_rules() -> None:
    assert safeguards.line(_config()) is None  # FedAvg's mean, nothing else
    line = safeguards.line(_dp())
    assert "\n" not in line
    for part in ("client-level DP", "Gaussian noise z = 1.1", "clipped to norm 0.5",
                 "Poisson-sampled at rate 0.2", "adding or removing one client", "RDP",
                 "delta = 1e-05", "uniform mean"):  # fmt: skip
        assert part in line, part
    adaptive = safeguards.line(_dp(dp_noise_multiplier=0.15, dp_clip_quantile=0.5))
    assert "adaptive clip norm from 0.5 (quantile 0.5)" in adaptive and "z = 0.15" in adaptive
    assert "no privacy guarantee" in safeguards.line(_dp(dp_noise_multiplier=0.0))
    robust = safeguards.line(_config(aggregator="trimmed-mean", trim_fraction=0.2,
                                     max_update_norm=3.0))  # fmt: skip
    assert "trimmed-mean (cutting 0.2 at each end)" in robust and "norm 3" in robust
    assert "DP" not in robust
    attack = _config(attack="sign-flip", attack_fraction=0.2, seed=2)
    ids = ", ".join(str(i) for i in safeguards.attackers(attack))
    assert f"client(s) {ids} upload sign-flipped updates" in safeguards.line(attack)
    scale = safeguards.line(_config(attack="scale", attack_scale=50.0))
    assert "upload x50 updates" in scale


def _record(config, r: int, answered, accepted, norms, clip: float | None) -> dict:
    """The safeguard fields of the run's strategy's record (`run.safeguards.strategy`)."""
    spec = SimpleNamespace(aggregator=safeguards.aggregator(config))
    plan = RoundPlan(r, np.asarray(answered), spec, clip, None)
    record = safeguards.strategy(config, lambda r: spec).record(
        plan, [], np.zeros(0), np.asarray(answered), accepted, norms)  # fmt: skip
    train = ("round", "clients_sampled", "train_loss", "train_loss_clients")
    return {k: v for k, v in record.items() if k not in train}


def test_record_fields() -> None:
    sampled = np.array([2, 5, 7])
    accepted = np.array([True, False, True])
    norms = np.array([0.5, 0.0, 2.25], np.float32)
    plain = _record(_config(), 3, sampled, accepted, norms, None)
    assert plain == {"clients_rejected": [5]}  # ids, not positions; no norms for the plain mean
    robust = _record(_config(aggregator="median"), 3, sampled, accepted, norms, None)
    assert robust == {"clients_rejected": [5], "update_norms": [0.5, 0.0, 2.25]}
    bounded = _record(_config(max_update_norm=1.0), 3, sampled, accepted, norms, None)
    assert bounded["update_norms"] == [0.5, 0.0, 2.25]  # a norm bound measures them too
    config = _dp()
    out = _record(config, 3, sampled, np.ones(3, bool), norms, 0.75)
    assert out["clients_rejected"] == [] and out["update_norms"] == [0.5, 0.0, 2.25]
    assert out["dp_clip"] == 0.75
    assert out["epsilon"] == pytest.approx(dp_reference_epsilon(1.1, 0.2, 3, 1e-5), rel=1e-9)
    empty = _record(config, 1, np.zeros(0, np.int32), np.zeros(0, bool),
                    np.zeros(0, np.float32), 0.5)  # fmt: skip
    assert empty["clients_rejected"] == [] and empty["update_norms"] == []


def test_summary_fields() -> None:
    history = [{"clients_rejected": [1], "epsilon": 0.5}, {"clients_rejected": []},
               {"clients_rejected": [0, 4], "epsilon": 0.9}]  # fmt: skip
    assert safeguards.summary(_config(aggregator="median"), history) == {
        "clients_rejected": 3, "aggregator": "median"}  # fmt: skip
    out = safeguards.summary(_dp(dp_max_epsilon=4.0, dp_clip_quantile=None), history)
    privacy = out["privacy"]
    assert out["clients_rejected"] == 3 and out["aggregator"] == "mean"
    assert privacy["epsilon"] == 0.9 and privacy["rounds"] == 3  # the last round's
    assert privacy["max_epsilon"] == 4.0 and privacy["clip"] == 0.5
    assert privacy["adaptive_clip_quantile"] is None
    assert privacy["noise_multiplier"] == 1.1 and privacy["sampling_rate"] == 0.2
    assert privacy["sampling"] == "poisson" and privacy["delta"] == 1e-5
    assert privacy["accountant"] == "rdp" and privacy["mechanism"] == "gaussian"
    assert privacy["weighting"].startswith("uniform")
    assert safeguards.summary(_dp(), [])["privacy"]["epsilon"] == 0.0
    assert safeguards.summary(_dp(dp_noise_multiplier=0.0), history)["privacy"][
        "noise_multiplier"] == 0.0  # fmt: skip


def test_start_lines_state_the_mechanism_and_the_rounds_a_budget_allows() -> None:
    plain = _config()
    # the plain mean: nothing to say
    assert safeguards.start_lines(plain, plain.federation.rounds) == []
    config = _dp(rounds=10, dp_max_epsilon=2.0)
    allowed = safeguards.rounds_allowed(config)
    lines = safeguards.start_lines(config, allowed)
    assert lines[0] == safeguards.line(config) and len(lines) == 3
    assert "private/clients.jsonl" in lines[1]  # where the per-client figures went
    eps = dp_reference_epsilon(1.1, 0.2, allowed, 1e-5)
    assert lines[2] == (f"--dp-max-epsilon 2 allows {allowed} of the 10 rounds "
                        f"(epsilon {eps:.3g} after them)")  # fmt: skip
    assert len(safeguards.start_lines(_dp(rounds=10), 10)) == 2  # no budget: no such line
    insecure = safeguards.start_lines(_dp(dp_insecure_reproducible_noise=True), 10)
    assert insecure[1].startswith("WARNING: --dp-insecure-reproducible-noise")
    assert "no privacy guarantee holds" in insecure[1]


def test_only_the_simulation_runs_a_simulated_attack() -> None:
    from fedjax_split.errors import UserError

    safeguards.check_deployable(_config(aggregator="median", max_update_norm=1.0))
    safeguards.check_deployable(_dp())
    with pytest.raises(UserError, match="--attack simulates attacking clients"):
        safeguards.check_deployable(_config(attack="sign-flip"))


"""Tests for fed/strategy.py: the algorithm object both transports call. Its plan samples the
round's clients (M of K from the seed, or Poisson from the server's secret), reads DP's clip
norm from the server state and takes a fresh secret noise key each round; its server step is the
example-weighted mean; its record has the fields and order metrics.jsonl's rows have."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_split.fed import accounting
from fedjax_split.fed.aggregation import Aggregator, init_state
from fedjax_split.fed.privacy import DPSpec
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import Sampling, Strategy
from fedjax_split.run import safeguards
from fedjax_split.run.config import resolve_config

SGD1 = optax.sgd(1.0)  # FedAvg's server: the new global part is the aggregate itself


@dataclasses.dataclass(frozen=True)
class Spec:
    """A round's spec as the server's step reads it (`fed.server_step.ServerSpec`)."""

    aggregator: Aggregator = Aggregator()
    server_optimizer: optax.GradientTransformation = SGD1
    wire_dtype: str = "float32"
    trained: frozenset[str] | None = None
    donate: bool = False


DP = Aggregator(dp=DPSpec(clip=1.0, noise_multiplier=1.0, denominator=2.0))
FOUR_OF_TEN = Sampling(10, 4, seed=7)


def _strategy(spec: Spec = Spec(), sampling: Sampling = FOUR_OF_TEN,
              mechanism: accounting.Mechanism | None = None) -> Strategy:  # fmt: skip
    return Strategy(sampling, lambda r: spec, mechanism, 1e-3)


def _state(spec: Spec) -> object:
    params = {"layer": {"kernel": jnp.zeros([2], jnp.float32)}}
    return init_server_state(params, spec.server_optimizer, spec.wire_dtype,
                             init_state(spec.aggregator))  # fmt: skip


def _global(state: object) -> np.ndarray:
    return np.asarray(state.global_params["layer"]["kernel"])


def test_the_plan_samples_m_of_k_from_the_seed_for_its_own_round() -> None:
    strategy = _strategy()
    state = _state(Spec())
    for r in (1, 2, 5):
        # the documented draw: numpy's default_rng([seed, round, 1]), M of K without replacement
        want = np.sort(np.random.default_rng([7, r, 1]).choice(10, size=4, replace=False))
        plan = strategy.plan(r, state, None)
        assert plan.round == r and plan.clients.tolist() == want.tolist()
    assert _strategy(sampling=Sampling(10, None, seed=7)).plan(3, state, None).clients.tolist() \
        == list(range(10))  # fmt: skip


def test_with_poisson_sampling_the_clients_come_from_the_secret_not_the_seed() -> None:
    secret = ServerSecret.fresh()
    state = _state(Spec())
    a = _strategy(sampling=Sampling(20, 5, seed=1, poisson=True))
    b = _strategy(sampling=Sampling(20, 5, seed=2, poisson=True))
    sizes = []
    for r in range(1, 201):
        ids = a.plan(r, state, secret).clients
        assert ids.tolist() == b.plan(r, state, secret).clients.tolist()  # the seed plays no part
        assert ids.tolist() == sorted(set(ids.tolist())) and all(0 <= i < 20 for i in ids)
        sizes.append(len(ids))
    # each client with probability M/K = 1/4: the mean size is M = 5 (std of the mean ~0.14)
    assert abs(np.mean(sizes) - 5) < 0.6 and len(set(sizes)) > 3
    other = ServerSecret.fresh()
    assert any(a.plan(r, state, other).clients.tolist() != a.plan(r, state, secret).clients.tolist()
               for r in range(1, 6))  # fmt: skip
    with pytest.raises(ValueError, match="secret"):
        a.plan(1, state, None)


def test_the_server_step_is_the_example_weighted_mean() -> None:
    spec = Spec()
    strategy = _strategy(spec)
    plan = strategy.plan(1, _state(spec), None)
    uploads = [{"layer": {"kernel": jnp.asarray([1.0, 2.0])}},
               {"layer": {"kernel": jnp.asarray([5.0, 10.0])}}]  # fmt: skip
    state, accepted, _ = strategy.aggregate(plan, _state(spec), uploads, np.asarray([1.0, 3.0]))
    # (1 * [1, 2] + 3 * [5, 10]) / 4; the unweighted mean would be [3, 6]
    np.testing.assert_allclose(_global(state), [4.0, 8.0], rtol=1e-6)
    assert np.asarray(accepted).tolist() == [True, True] and int(state.round) == 1
    nobody, accepted, norms = strategy.aggregate(plan, _state(spec), [], np.zeros([0]))
    np.testing.assert_array_equal(_global(nobody), [0.0, 0.0])  # nothing arrived: no move
    assert len(accepted) == len(norms) == 0 and int(nobody.round) == 1


def test_each_dp_round_draws_fresh_secret_noise_and_reads_the_clip_from_the_state() -> None:
    spec = Spec(aggregator=DP)
    strategy = _strategy(spec)
    secret = ServerSecret.fresh()
    state = _state(spec)._replace(aggregator={"clip": jnp.float32(0.25)})
    plans = [strategy.plan(r, state, secret) for r in (1, 2, 3)]
    assert [p.clip for p in plans] == [0.25, 0.25, 0.25]
    keys = [np.asarray(jax.random.key_data(p.noise_key)).tobytes() for p in plans]
    assert len(set(keys)) == 3  # never one key for two rounds
    upload = [{"layer": {"kernel": jnp.asarray([0.1, 0.1])}}]
    norm = np.asarray([np.hypot(0.1, 0.1)], np.float32)
    after = [_global(strategy.aggregate(p, state, upload, np.ones(1), norm)[0]) for p in plans]
    assert not np.allclose(after[0], after[1]) and not np.allclose(after[1], after[2])
    again = strategy.aggregate(plans[0], state, upload, np.ones(1), norm)[0]
    np.testing.assert_array_equal(_global(again), after[0])  # the key is the round's, fixed
    with pytest.raises(ValueError, match="secret noise key"):
        strategy.plan(1, state, None)  # a DP round never makes up a public key


def test_the_record_has_metrics_jsonls_fields_in_order() -> None:
    state = _state(Spec())
    plan = dataclasses.replace(_strategy().plan(3, state, None), clients=np.asarray([2, 5]))
    record = _strategy().record(
        plan,
        np.asarray([1.0, 4.0]),
        np.asarray([3.0, 1.0], np.float32),
        np.asarray([2, 5]),
        np.asarray([True, False]),
        np.zeros(2),
    )
    assert record == {"round": 3, "clients_sampled": [2, 5], "train_loss": 1.75,
                      "train_loss_clients": [1.0, 4.0], "clients_rejected": [5]}  # fmt: skip
    assert list(record) == ["round", "clients_sampled", "train_loss", "train_loss_clients",
                            "clients_rejected"]  # fmt: skip
    median = Spec(aggregator=Aggregator(rule="median"))
    plan = dataclasses.replace(_strategy(median).plan(1, state, None), clients=np.asarray([0]))
    robust = _strategy(median).record(plan, [2.0], np.ones(1), np.asarray([0]), [True], [0.5])
    assert robust["update_norms"] == [0.5] and robust["train_loss"] == 2.0


def test_a_dp_record_has_the_plans_clip_and_the_accountants_epsilon() -> None:
    spec = Spec(aggregator=DP)
    mech = accounting.Mechanism(1.0, 0.2)
    strategy = _strategy(spec, Sampling(10, 2, seed=0, poisson=True), mech)
    state = _state(spec)
    plan = strategy.plan(4, state, ServerSecret.fresh())
    record = strategy.record(plan, [], np.zeros(0), np.zeros(0, np.int64), [], [])
    assert list(record)[-2:] == ["dp_clip", "epsilon"] and record["dp_clip"] == 1.0
    assert record["epsilon"] == accounting.epsilon(mech, 4, 1e-3) > 0
    no_noise = _strategy(spec, Sampling(10, 2, seed=0, poisson=True), None)
    assert no_noise.record(plan, [], np.zeros(0), np.zeros(0, np.int64), [], [])["epsilon"] is None


def test_the_runs_strategy_is_built_from_the_config() -> None:
    config = resolve_config(overrides={"clients": 10, "clients_per_round": 2,
                                       "dp_noise_multiplier": 1.1, "dp_clip": 0.5})  # fmt: skip
    strategy = safeguards.strategy(config, lambda r: Spec(aggregator=DP))
    assert strategy.sampling == Sampling(10, 2, config.seed, poisson=True)
    assert strategy.mechanism == safeguards.mechanism(config)
    assert strategy.delta == config.privacy.dp_delta
    plain = safeguards.strategy(resolve_config(overrides={"clients": 4}), lambda r: Spec())
    assert plain.sampling.poisson is False and plain.mechanism is None

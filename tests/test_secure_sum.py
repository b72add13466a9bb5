"""The server's step from the sum alone (fed/secure_sum.py, through fed/strategy.py): FedAvg's
example-weighted mean of the updates, each coordinate clipped to the round's bound, DP's noised
sum with the same noise as the plain DP step, a non-finite update left out, and a round that
would sum one client trains nobody. References are numpy float64 from the definitions, or the
server's plain step (an independent implementation) within the fixed point's error."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.aggregation import Aggregator, init_state
from fedjax_split.fed.fixed_point import error_bound, quantise
from fedjax_split.fed.privacy import DPSpec
from fedjax_split.fed.secure_sum import COORDINATE_CLIP, client_vector, round_fixed_point
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import RoundPlan, Sampling, Strategy
from fedjax_split.run.config import resolve_config


@dataclasses.dataclass(frozen=True)
class Spec:
    aggregator: Aggregator = Aggregator(secure=True)
    server_optimizer: optax.GradientTransformation = optax.sgd(1.0)  # the aggregate itself
    wire_dtype: str = "float32"
    trained: frozenset[str] | None = None
    donate: bool = False


R = {"a": np.array([0.5, -0.25, 1.0], np.float32), "b": np.array([[0.1, 0.2]], np.float32)}


def _uploads(deltas: list[list[float]]) -> list[dict]:
    return [{"a": R["a"] + np.asarray(d[:3], np.float32), "b": R["b"] + np.asarray([d[3:]],
             np.float32)} for d in deltas]  # fmt: skip


def _step(spec: Spec, uploads: list[dict], weights: list[float], sampling: Sampling = None):
    strategy = Strategy(sampling or Sampling(len(uploads), None, 0), lambda r: spec)
    state = init_server_state({k: jnp.asarray(v) for k, v in R.items()}, spec.server_optimizer,
                              spec.wire_dtype, init_state(spec.aggregator))  # fmt: skip
    plan = strategy.plan(1, state, None)
    return strategy.aggregate(plan, state, uploads, np.asarray(weights, np.float32))


def _flat(params: dict) -> np.ndarray:
    return np.concatenate([np.ravel(params["a"]), np.ravel(params["b"])]).astype(np.float64)


def test_fedavg_from_the_sum_is_the_example_weighted_mean_of_the_updates() -> None:
    deltas = [[0.01, -0.02, 0.0, 0.005, 0.3], [-0.04, 0.01, 0.02, 0.0, -0.1],
              [0.002, 0.0, -0.03, 0.01, 0.05]]  # fmt: skip
    weights = [3, 5, 40]
    state, valid, _ = _step(Spec(), _uploads(deltas), weights)
    d = np.asarray(deltas, np.float64)
    want = _flat(R) + (np.asarray(weights, np.float64)[:, None] * d).sum(0) / sum(weights)
    got = _flat(state.global_params)
    fixed = round_fixed_point(Aggregator(secure=True), None, max(weights), 3)
    assert np.all(np.abs(got - want) <= error_bound(fixed, 3) / sum(weights) + 2e-7 * abs(want))
    unweighted = _flat(R) + d.mean(0)
    assert np.max(np.abs(got - unweighted)) > 1e-3  # the weights count
    assert valid.tolist() == [True, True, True]


def test_each_coordinate_is_clipped_to_the_bound() -> None:
    state, _, _ = _step(Spec(), _uploads([[3.0, -2.0, 0.5, 0.0, 0.0], [0.0] * 5]), [1, 1])
    want = _flat(R) + np.array([COORDINATE_CLIP, -COORDINATE_CLIP, 0.5, 0, 0]) / 2
    np.testing.assert_allclose(_flat(state.global_params), want, atol=1e-6)
    bounded = Spec(aggregator=Aggregator(max_update_norm=0.5, secure=True))
    state, _, _ = _step(bounded, _uploads([[0.6, 0.8, 0, 0, 0], [0.0] * 5]), [1, 1])
    want = _flat(R) + np.array([0.3, 0.4, 0, 0, 0]) / 2  # the update scaled to norm 0.5
    np.testing.assert_allclose(_flat(state.global_params), want, atol=1e-6)


@pytest.mark.parametrize("quantile", [None, 0.5])
def test_dp_from_the_sum_equals_the_plain_dp_step_with_the_same_noise(quantile) -> None:
    dp = DPSpec(clip=0.1, noise_multiplier=0.2, denominator=3.0, target_quantile=quantile)
    deltas = [[0.3, 0.0, 0.0, 0.0, 0.4], [0.01, 0.02, 0.0, 0.0, 0.0], [0.0, 0.0, -0.05, 0.0, 0.0]]
    uploads = _uploads(deltas)
    norms = np.linalg.norm(np.asarray(deltas), axis=1).astype(np.float32)
    results = []
    for secure in (False, True):
        spec = Spec(aggregator=Aggregator(dp=dp, secure=secure))
        strategy = Strategy(Sampling(3, None, 0), lambda r, spec=spec: spec)
        state = init_server_state({k: jnp.asarray(v) for k, v in R.items()}, spec.server_optimizer,
                                  spec.wire_dtype, init_state(spec.aggregator))  # fmt: skip
        plan = RoundPlan(1, np.arange(3), spec, 0.1, jax.random.key(42))
        results.append(strategy.aggregate(plan, state, uploads, np.ones(3, np.float32), norms)[0])
    plain, secure = results
    np.testing.assert_allclose(_flat(secure.global_params), _flat(plain.global_params), atol=2e-7)
    assert float(secure.aggregator["clip"]) == pytest.approx(float(plain.aggregator["clip"]),
                                                             rel=1e-6)  # fmt: skip
    if quantile is not None:
        assert float(plain.aggregator["clip"]) != pytest.approx(0.1)  # adaptive: it moved


def test_a_client_whose_update_is_not_finite_is_left_out() -> None:
    uploads = _uploads([[0.1, 0, 0, 0, 0], [np.nan, 0, 0, 0, 0], [0.3, 0, 0, 0, 0]])
    state, valid, _ = _step(Spec(), uploads, [1, 1, 1])
    assert valid.tolist() == [True, False, True]
    np.testing.assert_allclose(_flat(state.global_params)[0], R["a"][0] + 0.2, atol=1e-6)


def test_a_round_that_would_sum_one_client_trains_nobody() -> None:
    spec = Spec()
    strategy = Strategy(Sampling(5, 1, seed=0), lambda r: spec)
    state = init_server_state({k: jnp.asarray(v) for k, v in R.items()}, spec.server_optimizer,
                              spec.wire_dtype, init_state(spec.aggregator))  # fmt: skip
    assert len(strategy.plan(1, state, None).clients) == 0
    plain = Strategy(Sampling(5, 1, seed=0), lambda r: Spec(aggregator=Aggregator()))
    assert len(plain.plan(1, state, None).clients) == 1


def test_the_clients_vector_is_its_clipped_update_quantised_with_its_weight() -> None:
    fixed = round_fixed_point(Aggregator(max_update_norm=0.5, secure=True), None, 7, 3)
    upload = {"a": R["a"] + np.float32([0.6, 0.8, 0.0]), "b": R["b"]}
    got = client_vector(upload, R, 7, fixed, 0.5)
    want = quantise(np.float32([0.3, 0.4, 0.0, 0.0, 0.0]), 7, False, fixed)
    assert np.abs(got.view(np.int64) - want.view(np.int64)).max() <= 1  # one grid step at most
    assert got.view(np.int64)[-2:].tolist() == [7, 0]  # the weight, and clipped


@pytest.mark.parametrize(
    "flags, words",
    [({"aggregator": "median"}, "--aggregator mean"), ({"attack": "sign-flip"}, "--attack"),
     ({"chunk_size": 2}, "--chunk-size"), ({"clients_per_round": 1}, "at least 2")],
)  # fmt: skip
def test_what_cannot_work_on_a_sum_is_refused_at_start(flags: dict, words: str) -> None:
    with pytest.raises(UserError, match=words):
        resolve_config(overrides={"task": "sst2", "secure_aggregation": True, **flags})

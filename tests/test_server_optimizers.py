"""Server optimisers vs Reddi et al. Algorithm 2 and FedAvg(M), computed by hand in numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed import server_optimizers as so
from fedjax_split.fed.aggregation import weighted_mean

ROUNDS = 4


def _deltas() -> list[np.ndarray]:
    # Distinct values with mixed signs and magnitudes so v - Delta^2 changes sign for Yogi.
    rng = np.random.default_rng(0)
    scales = [1.0, 1e-3, 0.3, 2.0]
    return [(rng.standard_normal(6) * s).astype(np.float32) for s in scales]


def _run(opt: optax.GradientTransformation, x0: np.ndarray) -> list[np.ndarray]:
    """Feeds -Delta_t to `opt` for every round; Delta_t is fixed per round (not state dependent)."""
    x = {"w": jnp.asarray(x0)}
    state = opt.init(x)
    step = jax.jit(opt.update)
    out = []
    for d in _deltas():
        updates, state = step({"w": -jnp.asarray(d)}, state, x)
        x = optax.apply_updates(x, updates)
        out.append(np.asarray(x["w"]))
    return out


def _reference(rule: str, lr: float, b1: float, b2: float, tau: float, x0: np.ndarray):
    x, m, v = x0.astype(np.float64), np.zeros(6), np.full(6, tau**2)
    out = []
    for d in _deltas():
        d = d.astype(np.float64)
        m = b1 * m + (1 - b1) * d
        if rule == "adam":
            v = b2 * v + (1 - b2) * d**2
        elif rule == "yogi":
            v = v - (1 - b2) * d**2 * np.sign(v - d**2)
        else:
            v = v + d**2
        x = x + lr * m / (np.sqrt(v) + tau)
        out.append(x)
    return out


X0 = np.linspace(-1.0, 1.0, 6).astype(np.float32)


@pytest.mark.parametrize(
    "rule,opt",
    [
        ("adam", so.fedadam(0.1, b1=0.8, b2=0.95, tau=1e-2)),
        ("yogi", so.fedyogi(0.1, b1=0.8, b2=0.95, tau=1e-2)),
        ("adagrad", so.fedadagrad(0.1, tau=1e-2, b1=0.8)),
    ],
)
def test_adaptive_presets_follow_reddi_algorithm_2(rule: str, opt) -> None:
    got = _run(opt, X0)
    want = _reference(rule, 0.1, 0.8, 0.95, 1e-2, X0)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6)


def test_yogi_reference_exercises_both_signs() -> None:
    # Guard on the test data itself: the sign(v - Delta^2) term must take both signs.
    v, signs = np.full(6, 1e-4), set()
    for d in _deltas():
        s = np.sign(v - d.astype(np.float64) ** 2)
        signs |= set(s.tolist())
        v = v - 0.05 * d**2 * s
    assert {-1.0, 1.0} <= signs


def test_fedadagrad_default_keeps_algorithm_2_momentum() -> None:
    got = _run(so.fedadagrad(0.1, tau=1e-2), X0)
    want = _reference("adagrad", 0.1, 0.9, 0.0, 1e-2, X0)
    np.testing.assert_allclose(got[-1], want[-1], rtol=2e-5, atol=1e-6)
    plain = _run(so.fedadagrad(0.1, tau=1e-2, b1=0.0), X0)
    want_plain = _reference("adagrad", 0.1, 0.0, 0.0, 1e-2, X0)
    np.testing.assert_allclose(plain[-1], want_plain[-1], rtol=2e-5, atol=1e-6)


def test_no_bias_correction_differs_from_optax_adam() -> None:
    got = _run(so.fedadam(0.1, b1=0.9, b2=0.99, tau=1e-3), X0)[0]
    # One round, Reddi: x0 + lr * 0.1 D / (sqrt(0.01 D^2 + tau^2) + tau); optax.adam would be ~lr.
    d = _deltas()[0].astype(np.float64)
    want = X0 + 0.1 * 0.1 * d / (np.sqrt(0.99 * 1e-6 + 0.01 * d**2) + 1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    adam = _run(optax.adam(0.1, b1=0.9, b2=0.99, eps=1e-3), X0)[0]
    assert np.abs(adam - got).max() > 1e-3


def test_fedavgm_matches_heavy_ball() -> None:
    got = _run(so.fedavgm(0.5, momentum=0.7), X0)
    x, buf = X0.astype(np.float64), np.zeros(6)
    for d, g in zip(_deltas(), got, strict=True):
        buf = 0.7 * buf + (-d)
        x = x - 0.5 * buf
        np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-6)


def test_fedavg_lr1_is_the_weighted_mean_exactly() -> None:
    rng = np.random.default_rng(1)
    server = rng.standard_normal(50).astype(np.float32)
    # Clients near the server (as after local training): x + (mean - x) == mean in fp32.
    clients = server + 0.01 * rng.standard_normal((3, 50)).astype(np.float32)
    n = np.array([5, 20, 75])
    mean = weighted_mean({"w": clients}, n)
    g = jax.tree.map(lambda a, x: -(a - x), mean, {"w": server})
    opt = so.fedavg(1.0)
    updates, _ = opt.update(g, opt.init({"w": server}), {"w": server})
    new = optax.apply_updates({"w": jnp.asarray(server)}, updates)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(mean["w"]))
    want = (clients.astype(np.float64) * n[:, None]).sum(0) / n.sum()
    np.testing.assert_allclose(np.asarray(new["w"]), want, rtol=1e-6)


def test_schedule_and_user_chain_work_unchanged() -> None:
    sched = optax.linear_schedule(1.0, 0.5, transition_steps=ROUNDS)
    got = _run(so.fedadam(sched, b1=0.8, b2=0.95, tau=1e-2), X0)
    x, m, v = X0.astype(np.float64), np.zeros(6), np.full(6, 1e-4)
    for t, (d, g) in enumerate(zip(_deltas(), got, strict=True)):
        m = 0.8 * m + 0.2 * d
        v = 0.95 * v + 0.05 * d.astype(np.float64) ** 2
        x = x + (1.0 - 0.5 * t / ROUNDS) * m / (np.sqrt(v) + 1e-2)
        np.testing.assert_allclose(g, x, rtol=2e-5, atol=1e-6)
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(sched))
    got = _run(chain, X0)
    x = X0.astype(np.float64)
    for t, (d, g) in enumerate(zip(_deltas(), got, strict=True)):
        d = d.astype(np.float64)
        d = d * min(1.0, 1.0 / np.linalg.norm(d))
        x = x + (1.0 - 0.5 * t / ROUNDS) * d
        np.testing.assert_allclose(g, x, rtol=2e-5, atol=1e-6)


def test_get_by_name() -> None:
    assert isinstance(so.get("fedadam", learning_rate=0.1), optax.GradientTransformation)
    with pytest.raises(UserError, match="fedavg, fedavgm"):
        so.get("sgd")

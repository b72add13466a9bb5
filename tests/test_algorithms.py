"""fed.algorithms: the registry the CLI and the config read, and the optimisers it builds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed import algorithms
from fedjax_split.run.config import ExperimentConfig


def test_registry_names_presets_and_defaults() -> None:
    assert list(algorithms.ALGORITHMS) == [
        "fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad",
    ]  # fmt: skip
    assert [a.name for a in algorithms.ALGORITHMS.values() if a.prox] == ["fedprox"]
    assert algorithms.get("fedprox").server == "fedavg"
    with pytest.raises(UserError, match="unknown algorithm 'fedsplit'"):
        algorithms.get("fedsplit")


@pytest.mark.parametrize(
    ("name", "lr", "want"),
    # one server step from x = 1 with the clients' mean at 1.5 (Delta = 0.5), by hand
    [
        ("fedavg", None, 1.5),  # x + 1.0 * Delta
        ("fedprox", 0.5, 1.25),  # its server is FedAvg's
        ("fedavgm", None, 1.5),  # first step: momentum buffer = -Delta
        # the tuned default eta 1e-2, tau 1e-3 (docs/fedopt_tuning.md)
        ("fedadam", None, 1.0 + 1e-2 * 0.05 / (np.sqrt(0.99e-6 + 0.01 * 0.25) + 1e-3)),
    ],
)
def test_server_optimizer_steps_by_hand(name: str, lr: float | None, want: float) -> None:
    opt = algorithms.server_optimizer(name, lr)
    x = jnp.ones(2)
    updates, _ = opt.update(x - 1.5, opt.init(x), x)  # the pseudo-gradient -Delta
    np.testing.assert_allclose(np.asarray(x + updates), [want, want], rtol=1e-6)


def test_config_reads_the_registry() -> None:
    # tuned on the K=10 ramp and checked on K=3 (docs/fedopt_tuning.md)
    assert ExperimentConfig.of(algorithm="fedadam").federation.effective_server_lr == 1e-2
    assert ExperimentConfig.of(algorithm="fedyogi").federation.effective_server_lr == 1e-2
    assert ExperimentConfig.of(algorithm="fedadagrad").federation.effective_server_lr == 1e-2
    assert {a.tau for a in algorithms.ALGORITHMS.values() if a.adaptive} == {1e-3}
    assert ExperimentConfig.of(algorithm="fedavgm").federation.effective_server_lr == 1.0
    assert ExperimentConfig.of(algorithm="fedprox", mu=0.1).prox_mu == 0.1
    assert ExperimentConfig.of(algorithm="fedavg", mu=0.1).prox_mu == 0.0


def test_tau_reaches_the_adaptive_servers_and_only_them() -> None:
    """One FedAdam step by hand at tau = 0.1 (v starts at tau^2): Delta = 0.5, m = 0.05,
    v = 0.99 tau^2 + 0.01 Delta^2; the non-adaptive servers refuse a tau."""
    opt = algorithms.server_optimizer("fedadam", 1e-2, tau=0.1)
    x = jnp.ones(2)
    updates, state = opt.update(x - 1.5, opt.init(x), x)
    want = 1.0 + 1e-2 * 0.05 / (np.sqrt(0.99 * 0.01 + 0.01 * 0.25) + 0.1)
    np.testing.assert_allclose(np.asarray(x + updates), [want, want], rtol=1e-6)
    assert [a.name for a in algorithms.ALGORITHMS.values() if a.adaptive] == [
        "fedadam", "fedyogi", "fedadagrad"]  # fmt: skip
    with pytest.raises(UserError, match="--server-tau is for the adaptive servers"):
        algorithms.server_optimizer("fedavg", None, tau=0.1)

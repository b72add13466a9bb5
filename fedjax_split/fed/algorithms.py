"""The algorithm registry: a name -> the server optimiser, its default learning rate, and whether
clients add FedProx's proximal term. Written once; the CLI's choices and the config's defaults are
read from here.

Every algorithm combines with any parameter roles: FedSplitBERT is any of them with a critical
layer below L. Importing this module imports no jax or optax (flag parsing stays fast); the
optimiser is built on demand.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.errors import UserError


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A federated algorithm as a server optimiser preset plus the client's loss."""

    name: str
    server: str  # a fed.server_optimizers preset
    server_lr: float  # its default learning rate
    prox: bool = False  # clients add (mu/2) ||w_g - w_g_received||^2 (FedProx)
    summary: str = ""
    title: str = ""  # the name as papers write it, for the lines a person reads
    tau: float | None = None  # an adaptive server's tau (Reddi et al.); None: no such setting

    @property
    def adaptive(self) -> bool:
        return self.tau is not None


# FedAvg/FedProx/FedAvgM: eta_s = 1 makes the server step the weighted average of the clients'
# models (FedNLP's default). The adaptive rules (Reddi et al. Alg. 2) are tuned on the K=10 label
# ramp over Reddi et al.'s grid (tools/fedopt_tuning.py, docs/fedopt_tuning.md): a round of BERT
# fine-tuning moves a weight far less than tau = 1e-3, so Delta^2 is small beside v's start tau^2,
# sqrt(v) stays near tau and a step is about (eta_s / tau) / 2 times the moment m: a twentieth
# of FedAvg's first step at Reddi et al.'s untuned eta_s = tau = 1e-3 (FedAdam then ended at
# 0.561, the majority class). All three hold at eta_s = 1e-2 on a second preset (K=3); FedYogi's
# eta_s 10^-1.5, one test example better on K=10, overfit there.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("fedavg", "fedavg", 1.0, summary="weighted average of the clients' models",
                  title="FedAvg"),
        Algorithm("fedavgm", "fedavgm", 1.0, summary="server SGD with momentum 0.9",
                  title="FedAvgM"),
        Algorithm("fedprox", "fedavg", 1.0, prox=True, summary="FedAvg + proximal client term",
                  title="FedProx"),
        Algorithm("fedadam", "fedadam", 1e-2, summary="Reddi et al.'s FedAdam", title="FedAdam",
                  tau=1e-3),
        Algorithm("fedyogi", "fedyogi", 1e-2, summary="Reddi et al.'s FedYogi",
                  title="FedYogi", tau=1e-3),
        Algorithm("fedadagrad", "fedadagrad", 1e-2, summary="Reddi et al.'s FedAdagrad",
                  title="FedAdagrad", tau=1e-3),
    )
}  # fmt: skip


def get(name: str) -> Algorithm:
    """The algorithm called `name`; an unknown name is a UserError listing the known ones."""
    algorithm = ALGORITHMS.get(name)
    if algorithm is None:
        raise UserError(
            f"unknown algorithm {name!r}; pass --algorithm one of: {', '.join(ALGORITHMS)}"
        )
    return algorithm


def check_tau(name: str, tau: float | None) -> Algorithm:
    """The algorithm called `name`; a UserError when `tau` is given for one without a tau."""
    algorithm = get(name)
    if tau is not None and not algorithm.adaptive:
        adaptive = ", ".join(a.name for a in ALGORITHMS.values() if a.adaptive)
        raise UserError(f"--server-tau is for the adaptive servers ({adaptive}), not {name}")
    return algorithm


def server_optimizer(name: str, learning_rate: float | None = None,
                     tau: float | None = None) -> Any:  # fmt: skip
    """The algorithm's server optimiser (an optax GradientTransformation) at `learning_rate` and,
    for an adaptive one, `tau` (None: the algorithm's defaults)."""
    from fedjax_split.fed import server_optimizers  # optax: the flags import this module

    algorithm = check_tau(name, tau)
    lr = algorithm.server_lr if learning_rate is None else learning_rate
    if not algorithm.adaptive:
        return server_optimizers.get(algorithm.server, learning_rate=lr)
    tau = algorithm.tau if tau is None else tau
    return server_optimizers.get(algorithm.server, learning_rate=lr, tau=tau)

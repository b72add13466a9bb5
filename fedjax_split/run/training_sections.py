"""The run's training sections: how each client trains in a round (`ClientSettings`) and the
federation around it, its clients, rounds, server algorithm and layer schedule
(`FederationSettings`); each setting's own checks beside it (`check`).

The client optimiser's choices are copies of `fed.client`'s, kept here so that parsing the flags
imports no JAX; tests/test_config.py holds them equal. FedBT's schedule with LoRA, and the
sampled clients against the other sections' rules, are `run.cross_checks`'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.fed.algorithms import ALGORITHMS, check_tau
from fedjax_split.run.settings import FEDERATION, MODEL, Section, as_given
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.value_checks import (
    at_least_one,
    got,
    non_negative,
    number_above_zero,
    positive_number,
    require,
)

QUANTIZE = ("none", "fp16", "bf16")
LAYER_SCHEDULES = ("none", "fedbt")
CLIENT_OPTIMIZERS = ("adamw", "sgd")  # fed.client.client_optimizer's names
LR_SCHEDULES = ("constant", "linear")


def _server_lr_help() -> str:
    """--server-lr's help, with each algorithm's default from the registry."""
    return "Server learning rate; unset: the algorithm's default (" + ", ".join(
        f"{a.name} {a.server_lr:.3g}" for a in ALGORITHMS.values()) + ")."  # fmt: skip


def _server_tau_help() -> str:
    return (
        "The adaptive servers' tau (the step is lr m / (sqrt(v) + tau)); unset: the algorithm's "
        "default ("
        + ", ".join(f"{a.name} {a.tau:g}" for a in ALGORITHMS.values() if a.adaptive)
        + "; docs/fedopt_tuning.md)."
    )


@dataclasses.dataclass(frozen=True)
class ClientSettings(Section):
    """How each client trains in a round: its epochs, batches, optimiser and loss."""

    local_epochs: int = _setting(
        3, "Epochs each client trains on its data per round.", group=FEDERATION, metavar="E"
    )
    batch_size: int = _setting(16, "Client mini-batch size.", group=MODEL, metavar="B")
    lr: float = _setting(
        2e-5,
        "Client learning rate (AdamW's; SGD's with --client-optimizer sgd).",
        group=MODEL,
        metavar="LR",
    )
    client_optimizer: str = _setting(
        "adamw",
        "Client optimiser: AdamW (weight decay 0.01 on matrices) or plain SGD (FedNLP's FedAvg "
        "and FedProx clients). Fresh each round.",
        choices=CLIENT_OPTIMIZERS,
        group=MODEL,
    )
    lr_schedule: str = _setting(
        "constant",
        "Client learning rate over each round: constant, or linear (transformers' "
        "get_linear_schedule_with_warmup over the client's own steps in the round, FedNLP's).",
        choices=LR_SCHEDULES,
        group=MODEL,
    )
    warmup_ratio: float = _setting(
        0.0,
        "--lr-schedule linear: the share of a client's steps in a round spent warming up "
        "(FedNLP's 0.06).",
        group=MODEL,
        metavar="FRACTION",
    )
    client_clip_norm: float | None = _setting(
        None,
        "Clip each client step's gradient to this global L2 norm (FedNLP's 1.0); not client-level "
        "DP's clipping (--dp-clip), which clips a round's update.",
        metavar="C",
        group=MODEL,
    )
    mu: float = _setting(
        0.01,
        "FedProx proximal weight (used only with --algorithm fedprox).",
        group=MODEL,
        metavar="MU",
    )

    def check(self, config: Any) -> None:
        """Counts of at least 1, the learning rate, FedProx's mu, the clipping, and the warm-up
        in [0, 1) and only with the linear schedule."""
        at_least_one(config, "local_epochs", "batch_size")
        positive_number(config, "lr")
        non_negative(config, "mu")
        number_above_zero(config, "client_clip_norm")
        ratio = self.warmup_ratio
        require(config, "warmup_ratio", math.isfinite(ratio) and 0 <= ratio < 1, "in [0, 1)")
        if ratio and self.lr_schedule != "linear":
            raise UserError(f"{as_given(config, 'warmup_ratio')} needs --lr-schedule linear (the "
                            "constant rate has no warm-up)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FederationSettings(Section):
    """The federation: its clients, its rounds, the server's algorithm, the layers a round
    trains, the wire dtype."""

    algorithm: str = _setting(
        "fedavg",
        "Server algorithm; FedSplitBERT is any algorithm with --critical-layer < L.",
        choices=tuple(ALGORITHMS),
        group=MODEL,
    )
    layer_schedule: str = _setting(
        "none",
        "Which layers a round trains: none (all that the roles train), or fedbt (FedBT's "
        "fine-tuning, Algorithm 2: one shared model; round r trains the top layers and the "
        "head, one layer more each round up to --cycle-factor, then from the top again; only "
        "those are uploaded; the embeddings and the layers below the cycle stay frozen). "
        "docs/fedbt.md.",
        choices=LAYER_SCHEDULES,
        group=MODEL,
    )
    cycle_factor: int | None = _setting(
        None,
        "--layer-schedule fedbt: the cycle's length c, so the top c layers take turns "
        "(unset: L // 2, at least 1: the journal's 6 of 12).",
        metavar="C",
        group=MODEL,
    )
    clients: int = _setting(3, "Number of clients K.", group=FEDERATION, metavar="K")
    clients_per_round: int | None = _setting(
        None,
        "Clients sampled each round; 'all' = every client (the paper).",
        metavar="M",
        group=FEDERATION,
    )
    rounds: int = _setting(10, "Number of federated rounds.", group=FEDERATION, metavar="N")
    quantize: str = _setting(
        "none",
        "Wire dtype of the global weights in both directions (the paper's +16-bit).",
        choices=QUANTIZE,
        group=FEDERATION,
    )
    server_lr: float | None = _setting(None, _server_lr_help, group=MODEL, metavar="LR")
    server_tau: float | None = _setting(None, _server_tau_help, group=MODEL, metavar="TAU")

    @property
    def sampled_clients(self) -> int:
        """Clients per round; None means all clients (the paper's cross-silo setting)."""
        return self.clients if self.clients_per_round is None else self.clients_per_round

    @property
    def effective_server_lr(self) -> float:
        return ALGORITHMS[self.algorithm].server_lr if self.server_lr is None else self.server_lr

    def check(self, config: Any) -> None:
        """The clients and those a round, the rounds, the server's lr and tau (tau for the
        adaptive servers only), and --cycle-factor: only with FedBT, at least 1 (at most L is
        checked with the model)."""
        at_least_one(config, "clients")
        per_round = self.clients_per_round
        if per_round is not None and not 1 <= per_round <= self.clients:
            raise UserError(
                f"--clients-per-round must be in 1..{self.clients}, got "
                f"{got(config, 'clients_per_round')}; {as_given(config, 'clients')} sets the "
                "clients"
            )
        at_least_one(config, "rounds")
        positive_number(config, "server_lr")
        number_above_zero(config, "server_tau")
        check_tau(self.algorithm, self.server_tau)
        if self.layer_schedule == "none" and self.cycle_factor is not None:
            raise UserError(f"{as_given(config, 'cycle_factor')} needs --layer-schedule fedbt")
        at_least_one(config, "cycle_factor")

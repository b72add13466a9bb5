"""The federated algorithm as one object: what every transport of a round asks of it.

A `Strategy` is built once per run (`run.safeguards.strategy` for fine-tuning,
`run.pretrain_setup.strategy` for further pre-training). Each round a transport (the
simulations, `run.experiment.Simulation.step` and `run.pretraining.run_one_round`; the Flower
servers, `deploy.rounds.run_round` and `deploy.pretrain_server.run_round`) calls:
1. `plan(r, server_state, secret)`: the round's `RoundPlan`: the clients sampled, the round's
   spec (what is trained and sent and in which dtype: FedSplitBERT's split, FedBT's layer
   schedule and FedBFPT's trained layer are `round_spec_for`'s), the layers each client's model
   runs (`layers_for`: FedBFPT's small models), DP's clip norm and the server's noise key;
2. moves arrays: sends the global part, trains the clients, receives their uploads (its own I/O);
3. `aggregate(plan, server_state, uploads, weights, norms)`: the server's step
   (`fed.server_step`; robust rules and DP inside); with secure aggregation the deployment,
   which holds only the sum, calls `aggregate_sum` (`fed.secure_sum`);
4. `record(plan, ...)`: the round's training and safeguard figures for metrics.jsonl.
The secret stays the server's (`fed.secret`): the noise key and DP's Poisson sample come from
it, never from the seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.fed import accounting
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.secure_sum import round_fixed_point
from fedjax_split.fed.server import ServerState
from fedjax_split.fed.server_step import (
    ServerSpec,
    checked_noise_key,
    secure_round,
    server_only_step,
    server_round,
)

SAMPLING_PURPOSE = 1  # np.random.default_rng([seed, round, SAMPLING_PURPOSE])


def sample_clients(
    num_clients: int, clients_per_round: int | None, seed: int, round_index: int
) -> np.ndarray:
    """Sorted ids of the clients taking part in a round: all, or m of K without replacement."""
    if clients_per_round is None or clients_per_round >= num_clients:
        return np.arange(num_clients, dtype=np.int32)
    if clients_per_round < 1:
        raise UserError(f"clients per round must be >= 1, got {clients_per_round}; use 1..K")
    rng = np.random.default_rng([seed, round_index, SAMPLING_PURPOSE])
    return np.sort(rng.choice(num_clients, size=clients_per_round, replace=False)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Which clients a round takes: every client; M of K without replacement (from the seed);
    or with `poisson` (client-level DP, M < K) each client independently with probability M/K,
    drawn from the server's secret: a sample anyone could recompute from the seed would void
    the accountant's amplification by sampling."""

    clients: int  # K
    per_round: int | None  # M (None: every client)
    seed: int
    poisson: bool = False

    def sample(self, r: int, secret: ServerSecret | None = None) -> np.ndarray:
        """Round r's sorted client ids (with `poisson`, possibly none)."""
        if self.poisson:
            if secret is None:
                raise ValueError("DP's Poisson sample needs the server's secret (fed.secret)")
            return secret.poisson_sample(self.clients, self.per_round / self.clients, r)
        return sample_clients(self.clients, self.per_round, self.seed, r)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What the server decided for round r before any client runs."""

    round: int
    clients: np.ndarray  # sorted ids of the sampled clients
    spec: Any  # the round's spec (`sim.round_spec.RoundSpec`, a `fed.server_step.ServerSpec`)
    clip: float | None  # client-level DP: the clip norm the clients clip their updates to
    noise_key: jax.Array  # the server's DP noise key of the round (a fixed unused key without)
    # per sampled client, the global layer at each position of the model it runs (FedBFPT's
    # small models, `fed.layerwise`); None: every client runs the whole model
    layers: tuple[tuple[int, ...], ...] | None = None

    @property
    def trained(self) -> frozenset[str] | None:
        """The global paths the round trains and the clients send (None: the whole global part)."""
        return self.spec.trained


def train_record(
    r: int, sampled: Sequence[int], losses: np.ndarray, weights: np.ndarray
) -> dict[str, Any]:
    """A round record's training part: the sampled clients, each one's mean loss, and their
    example-weighted mean (the simulation's and the Flower server's rounds write the same)."""
    losses = np.asarray(losses, np.float64)
    return {
        "round": r,
        "clients_sampled": [int(c) for c in sampled],
        # None in a round without clients (DP's Poisson sampling may draw none)
        "train_loss": float(np.sum(losses * weights) / np.sum(weights)) if len(losses) else None,
        "train_loss_clients": losses.tolist(),
    }


def safeguard_record(
    answered: np.ndarray, accepted: Any, norms: Any, *, measured: bool, dp: bool,
    clip: float | None, epsilon: float | None,
) -> dict[str, Any]:  # fmt: skip
    """A round's safeguard figures: the rejected uploads among those `answered` (always), the
    update norms when the server `measured` them, with DP the clip norm and epsilon after it."""
    accepted = np.asarray(accepted, bool)
    out: dict[str, Any] = {"clients_rejected": [int(c) for c in answered[~accepted]]}
    if measured:
        out["update_norms"] = [float(n) for n in np.asarray(norms)]
    if dp:
        out["dp_clip"] = clip
        out["epsilon"] = epsilon
    return out


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A run's federated algorithm: sampling, the round's plan, the server's step, the record.

    `round_spec_for(r)`: round r's spec (the model's schedule); `layers_for(r, clients)`: the
    layers each sampled client's model runs (None: the whole model); `mechanism` and `delta`: the
    accountant's (None without DP's noise), for epsilon after each round."""

    sampling: Sampling
    round_spec_for: Callable[[int], ServerSpec]
    mechanism: accounting.Mechanism | None = None
    delta: float = 1e-5
    layers_for: Callable[[int, np.ndarray], tuple[tuple[int, ...], ...]] | None = None

    def sample(self, r: int, secret: ServerSecret | None = None) -> np.ndarray:
        return self.sampling.sample(r, secret)

    def plan(self, r: int, server_state: ServerState, secret: ServerSecret | None) -> RoundPlan:
        """Round r's plan. The clip norm is read here, before a round donates the server
        state's buffers; the noise key comes from the server's secret alone."""
        spec = self.round_spec_for(r)
        dp = spec.aggregator.dp is not None
        clip = float(server_state.aggregator["clip"]) if dp else None
        noise_key = checked_noise_key(spec, None if secret is None else secret.noise_key(r))
        clients = self.sample(r, secret)
        if spec.aggregator.secure and len(clients) < 2:  # a sum of one is that client's update
            clients = clients[:0]  # (DP's Poisson sample may draw one): the server's step alone
        layers = None if self.layers_for is None else self.layers_for(r, clients)
        return RoundPlan(r, clients, spec, clip, noise_key, layers)

    def aggregate(
        self, plan: RoundPlan, server_state: ServerState, uploads: Sequence[Any],
        weights: np.ndarray, norms: np.ndarray | None = None,
    ) -> tuple[ServerState, jax.Array, jax.Array]:  # fmt: skip
        """The server's step over the uploads taken (fp32 wire images in client order, their
        example counts, with DP their norms before clipping): (new state, accepted [K], update
        norms [K]). No upload (nobody sampled, or all rejected): the step on nothing."""
        if not uploads:
            state = server_only_step(plan.spec)(server_state, plan.noise_key)
            return state, np.zeros([0], bool), np.zeros([0], np.float32)
        state, (valid, out_norms) = server_round(plan.spec, server_state, tuple(uploads),
                                                 weights, plan.noise_key, norms)  # fmt: skip
        return state, valid, out_norms

    def aggregate_sum(
        self, plan: RoundPlan, server_state: ServerState, total: np.ndarray, fixed: FixedPoint
    ) -> ServerState:
        """The server's step from secure aggregation's sum alone (`fed.secure_sum`): the
        deployment's, whose sum SecAgg+ unmasks (the simulation's `aggregate` sums the same)."""
        return secure_round(plan.spec, server_state, total, fixed, plan.noise_key)

    def fixed_point(self, plan: RoundPlan, max_weight: int) -> FixedPoint:
        """Round `plan`'s quantisation for secure aggregation (`fed.secure_sum`)."""
        return round_fixed_point(plan.spec.aggregator, plan.clip, max_weight, len(plan.clients))

    def epsilon(self, rounds_done: int) -> float | None:
        """The privacy spent after `rounds_done` rounds (None without DP's noise)."""
        return None if self.mechanism is None else accounting.epsilon(
            self.mechanism, rounds_done, self.delta)  # fmt: skip

    def record(
        self, plan: RoundPlan, losses: Any, weights: np.ndarray, answered: np.ndarray,
        accepted: Any, norms: Any,
    ) -> dict[str, Any]:  # fmt: skip
        """The round's record so far: `train_record` over the sampled clients (the losses and
        example counts of those trained), then `safeguard_record` over those that `answered`."""
        aggregator = plan.spec.aggregator
        dp = aggregator.dp is not None
        record = train_record(plan.round, plan.clients.tolist(), losses, weights)
        record.update(safeguard_record(
            np.asarray(answered), accepted, norms,
            measured=not (aggregator.plain or aggregator.secure), dp=dp,
            clip=plan.clip, epsilon=self.epsilon(plan.round) if dp else None,
        ))  # fmt: skip
        return record

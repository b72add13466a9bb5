"""What a config says of the server's safeguards: robust aggregation, client-level DP and its
accounting, and the attack a study simulates against them.

The same for the simulation and the Flower server: which clients a round samples (Poisson with
DP, so that the accountant's amplification holds, drawn from the server's secret), the
`fed.aggregation.Aggregator`, the privacy spent after each round (`fed.accounting`), the rounds
a budget allows, and what of a round's record a DP run may publish (`public_record`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.fed import accounting, aggregation, privacy
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.server_step import ServerSpec
from fedjax_split.fed.strategy import Sampling, Strategy
from fedjax_split.run import outputs

if TYPE_CHECKING:  # run.cross_checks validates through aggregator(): no cycle at run time
    from fedjax_split.run.config import ExperimentConfig

ATTACK_PURPOSE = 2  # np.random.default_rng([seed, ATTACK_PURPOSE]) draws the attackers


def aggregator(config: ExperimentConfig) -> Any:
    """The `fed.aggregation.Aggregator` the config asks for (DP's denominator: the expected
    clients a round, M)."""
    dp = None
    if config.privacy.dp:
        dp = privacy.DPSpec(
            clip=float(config.privacy.dp_clip),
            noise_multiplier=float(config.privacy.dp_noise_multiplier),
            denominator=float(config.federation.sampled_clients),
            target_quantile=config.privacy.dp_clip_quantile,
        )
    return aggregation.Aggregator(
        rule=config.privacy.aggregator,
        trim_fraction=config.privacy.trim_fraction,
        max_update_norm=config.privacy.max_update_norm,
        dp=dp,
        secure=config.privacy.secure_aggregation,
    )


def mechanism(config: ExperimentConfig) -> Any:
    """The accountant's `fed.accounting.Mechanism`, or None (no DP, or no noise to account)."""
    priv, fed = config.privacy, config.federation
    if not priv.dp or priv.dp_noise_multiplier == 0:
        return None
    rate = fed.sampled_clients / fed.clients
    return accounting.Mechanism(float(priv.dp_noise_multiplier), rate, priv.dp_accountant)


def server_secret(config: ExperimentConfig) -> ServerSecret | None:
    """A new run's server secret for DP's noise and sample (`fed.secret`): from the OS's entropy,
    or from the seed under --dp-insecure-reproducible-noise; None without DP."""
    if not config.privacy.dp:
        return None
    return ServerSecret.for_run(config.seed, config.privacy.dp_insecure_reproducible_noise)


def sampling(config: ExperimentConfig) -> Sampling:
    """The run's `fed.strategy.Sampling`: every client; M of K without replacement; or, with DP
    and M < K, each client independently with probability M/K (Poisson: the sampling the
    accountant assumes), drawn from the server's secret."""
    federation = config.federation
    return Sampling(
        federation.clients, federation.sampled_clients, config.seed, config.poisson_sampling
    )


def sample(config: ExperimentConfig, r: int, secret: ServerSecret | None = None) -> np.ndarray:
    """Round r's clients (`sampling`; with DP's Poisson sample a round may have no client)."""
    return sampling(config).sample(r, secret)


def strategy(config: ExperimentConfig, round_spec_for: Callable[[int], ServerSpec]) -> Strategy:
    """The run's `fed.strategy.Strategy`: its sampling, the model's round schedule
    (`run.pieces.Model.round_spec_for`) and DP's accountant."""
    return Strategy(sampling(config), round_spec_for, mechanism(config), config.privacy.dp_delta)


# A round record's fields that name or measure single clients: outside DP's guarantee (which
# covers the global parts released), so a DP run keeps them in the server-private file only.
PER_CLIENT = ("clients_sampled", "train_loss_clients", "clients", "update_norms",
              "clients_rejected", "clients_failed", "eval_failed",
              # one client's figure, or near it; and the global model's per client
              "worst_client", "p10_client", "global_clients")  # fmt: skip
COVERED = "the sequence of global parts the server releases (and the adaptive clip norm)"
NOT_COVERED = (
    "evaluation on the clients' own test data (its means over clients are published)",
    "the number of clients taking part each round (its bytes and costs are published)",
)


def withheld(config: ExperimentConfig) -> bool:
    """Whether the run's published files leave out the per-client figures: DP without
    --dp-publish-clients."""
    return config.privacy.dp and not config.privacy.dp_publish_clients


def partition_path(config: ExperimentConfig, run_dir: Path) -> Path:
    """Where the run writes partition.json (each client's examples and label shares): the run
    directory, or under DP (`withheld`) the server-private folder, created here."""
    if not withheld(config):
        return run_dir / "partition.json"
    return outputs.private_dir(run_dir) / "partition.json"


def publisher(config: ExperimentConfig) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
    """The driver's `publish` (what metrics.jsonl may publish of a record): `public_record` under
    DP (`withheld`), else None (everything, and no private file)."""
    return functools.partial(public_record, config) if withheld(config) else None


def public_record(config: ExperimentConfig, record: dict[str, Any]) -> dict[str, Any]:
    """What metrics.jsonl and summary.json publish of a round's record: all of it, or under DP
    (`withheld`) the record less its per-client fields, with the count of uploads rejected."""
    if not withheld(config):
        return record
    out = {k: v for k, v in record.items() if k not in PER_CLIENT}
    if "clients_rejected" in record:
        out["num_rejected"] = len(record["clients_rejected"])
    return out


def attackers(config: ExperimentConfig) -> np.ndarray:
    """The attacking clients' ids (sorted; the same every round): a fraction of K, at least one."""
    if config.privacy.attack == "none":
        return np.zeros([0], np.int64)
    count = max(1, round(config.privacy.attack_fraction * config.federation.clients))
    rng = np.random.default_rng([config.seed, ATTACK_PURPOSE])
    return np.sort(rng.choice(config.federation.clients, size=count, replace=False))


def attack_factors(config: ExperimentConfig, sampled: np.ndarray) -> np.ndarray | None:
    """`fed.aggregation.tampered`'s factors [K] for a round's sampled clients, or None."""
    if config.privacy.attack == "none":
        return None
    factor = -1.0 if config.privacy.attack == "sign-flip" else float(config.privacy.attack_scale)
    return np.where(np.isin(sampled, attackers(config)), factor, 1.0).astype(np.float32)


def epsilon(config: ExperimentConfig, rounds_done: int) -> float | None:
    """The privacy spent after `rounds_done` rounds at --dp-delta (None without DP's noise)."""
    mech = mechanism(config)
    if mech is None:
        return None
    return accounting.epsilon(mech, rounds_done, config.privacy.dp_delta)


def rounds_allowed(config: ExperimentConfig) -> int:
    """The rounds the run may do: --rounds, or fewer where --dp-max-epsilon stops it first."""
    priv, fed = config.privacy, config.federation
    mech = mechanism(config)
    if mech is None or priv.dp_max_epsilon is None:
        return fed.rounds
    return accounting.rounds_within(mech, priv.dp_delta, priv.dp_max_epsilon, fed.rounds)


def line(config: ExperimentConfig) -> str | None:
    """One line on what protects the global part, for the run's start (None: nothing beyond the
    plain mean)."""
    privacy = config.privacy
    parts = []
    if privacy.dp:
        mech = mechanism(config)
        adaptive = privacy.dp_clip_quantile is not None
        norm, quantile = privacy.dp_clip, privacy.dp_clip_quantile
        clip = (f"adaptive clip norm from {norm:g} (quantile {quantile:g})" if adaptive
                else f"clip norm {norm:g}")  # fmt: skip
        if mech is None:
            parts.append(f"DP clipping ({clip}) with no noise (z = 0): no privacy guarantee")
        else:
            text = accounting.describe(mech, privacy.dp_delta, None if adaptive else norm)
            parts.append(text + ("; " + clip) * adaptive + "; uniform mean over the expected "
                         "clients a round (not example-weighted)")
    if privacy.aggregator != "mean":
        trim = f" (cutting {privacy.trim_fraction:g} at each end)" * (privacy.aggregator
                                                                     == "trimmed-mean")
        parts.append(f"coordinate-wise {privacy.aggregator}{trim} over the clients, unweighted")
    if privacy.max_update_norm is not None:
        parts.append(f"updates clipped to norm {privacy.max_update_norm:g}")
    if privacy.attack != "none":
        what = "sign-flipped" if privacy.attack == "sign-flip" else f"x{privacy.attack_scale:g}"
        ids = ", ".join(map(str, attackers(config)))
        parts.append(f"simulated attack: client(s) {ids} upload {what} updates")
    return "; ".join(parts) if parts else None


def start_lines(config: ExperimentConfig, rounds: int) -> list[str]:
    """The run's first lines on its safeguards (`line`) and on the rounds DP's budget allows
    (`rounds`: `rounds_allowed`'s), for the simulation and the Flower server alike."""
    priv, fed = config.privacy, config.federation
    first = line(config)
    out = [] if first is None else [first]
    if priv.dp and priv.dp_insecure_reproducible_noise:
        out.append("WARNING: --dp-insecure-reproducible-noise: the DP noise and client sample "
                   "follow --seed, so anyone who knows it can remove the noise; no privacy "
                   "guarantee holds for this run, whatever epsilon says")  # fmt: skip
    elif withheld(config):
        out.append("DP: per-client figures go to private/clients.jsonl (the server's own), not "
                   "to metrics.jsonl")  # fmt: skip
    if rounds < fed.rounds and priv.dp_max_epsilon is not None:
        out.append(f"--dp-max-epsilon {priv.dp_max_epsilon:g} allows {rounds} of the "
                   f"{fed.rounds} rounds (epsilon {epsilon(config, rounds):.3g} after them)")
    return out


def check_deployable(config: ExperimentConfig) -> None:
    """UserError for what only the simulation runs (a study's simulated attack)."""
    if config.privacy.attack != "none":
        raise UserError(
            "--attack simulates attacking clients in the simulation only; drop it for Flower "
            "(a real attacker is a node: the server's --aggregator and --max-update-norm "
            "apply there too)"
        )


def summary(config: ExperimentConfig, history: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's safeguard fields: the uploads rejected, and with DP the mechanism as the
    accountant was told it and the epsilon spent."""
    out: dict[str, Any] = {
        "clients_rejected": sum(len(h.get("clients_rejected", ())) for h in history),
        "aggregator": config.privacy.aggregator,
    }
    if config.privacy.dp:
        mech = mechanism(config)
        event = {"noise_multiplier": 0.0} if mech is None else accounting.as_dict(
            mech, config.privacy.dp_delta)  # fmt: skip
        out["privacy"] = {
            **event,
            "noise": ("INSECURE: regenerable from the seed (--dp-insecure-reproducible-noise); "
                      "no guarantee holds" if config.privacy.dp_insecure_reproducible_noise
                      else "secret: drawn from the server's OS-entropy key"),
            "covers": COVERED,
            "not_covered": [*NOT_COVERED, *(("each client's figures in metrics.jsonl "
                                             "(--dp-publish-clients)",)
                                            if config.privacy.dp_publish_clients else ())],
            "per_client_figures": ("metrics.jsonl" if config.privacy.dp_publish_clients
                                   else "private/clients.jsonl"),
            "clip": config.privacy.dp_clip,
            "adaptive_clip_quantile": config.privacy.dp_clip_quantile,
            "weighting": "uniform over the expected clients a round",
            "epsilon": history[-1].get("epsilon") if history else 0.0,
            "max_epsilon": config.privacy.dp_max_epsilon,
            "rounds": len(history),
        }
    return out

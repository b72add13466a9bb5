"""The rules between a run's config sections: settings that are fine alone and impossible
together. Each section checks its own values (`Section.check`, beside the settings); what needs
two sections is here, in one place, run after the sections' own checks by `run.config.validate`,
and, for the critical layer, once the model's depth is known (`validate_critical_layer`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedjax_split.errors import UserError
from fedjax_split.run.model_section import HALF
from fedjax_split.run.settings import as_given, drop
from fedjax_split.run.sites import check_site_dirs

if TYPE_CHECKING:  # run.config runs these checks: it imports this module
    from fedjax_split.run.config import ExperimentConfig


def check_across_sections(config: ExperimentConfig) -> None:
    """The rules between sections that need no data or model: FedBT's schedule with LoRA, the
    sites with the clients, and the server's aggregation with the clients a round and the chunk
    size (`check_aggregation`)."""
    check_schedule(config)
    check_site_dirs(config)  # --site-data: one existing directory per client
    check_aggregation(config)


def check_schedule(config: ExperimentConfig) -> None:
    """FedBT's schedule trains whole layers: no LoRA (its one shared model:
    `validate_critical_layer`)."""
    if config.federation.layer_schedule == "fedbt" and config.model.lora_rank is not None:
        raise UserError(
            f"{as_given(config, 'layer_schedule')} trains whole layers, not LoRA adapters "
            f"({as_given(config, 'lora_rank')}): "
            f"{drop(config, 'lora_rank', unset='--lora-rank none')}, or "
            f"{drop(config, 'layer_schedule')}"
        )


def check_aggregation(config: ExperimentConfig) -> None:
    """The server's aggregation against the clients a round and the runtime: a trimmed mean
    that trims somebody, secure aggregation of one client at a time and of at least two a round,
    and DP's own checks of its calibration (`run.safeguards.aggregator`: the quantile,
    z < M/10, ...)."""
    privacy_cfg, runtime_cfg = config.privacy, config.runtime
    sampled = config.federation.sampled_clients
    if privacy_cfg.aggregator == "trimmed-mean" and not privacy_cfg.dp:  # DP: privacy's refusal
        check_trimming(privacy_cfg.trim_fraction, sampled)
    if privacy_cfg.secure_aggregation:
        if runtime_cfg.chunk_size not in (None, 1):
            raise UserError(
                f"--chunk-size {runtime_cfg.chunk_size} with --secure-aggregation: each client's "
                "upload is quantised on its own; leave it unset"
            )
        if sampled < 2:
            raise UserError("--secure-aggregation needs at least 2 clients a round (the sum of "
                            "one is its update): raise --clients-per-round")  # fmt: skip
    if privacy_cfg.dp:
        from fedjax_split.run import safeguards  # JAX: the flags' modules import none

        safeguards.aggregator(config)


def check_trimming(trim_fraction: float, clients: int) -> None:
    """A UserError unless the trimmed mean of `clients` a round cuts at least one from each end:
    with floor(f M) = 0 (the default 0.1 below 10 clients, e.g. the paper's 3) it would silently
    be the plain unweighted mean. The numbers it suggests are `fed.robust`'s own counts."""
    from fedjax_split.fed import robust  # JAX, as above

    if robust.trim_count(trim_fraction, clients) > 0:
        return
    fraction = robust.least_trimming_fraction(clients)
    fewest = robust.fewest_clients_trimmed(trim_fraction)
    if fraction is None:  # under 3 clients no fraction below 1/2 cuts any
        fix = (f"at least {fewest} clients a round" if fewest is not None else
               f"at least 3 clients a round and --trim-fraction "
               f"{robust.least_trimming_fraction(3):g} or more")  # fmt: skip
    else:
        fix = f"--trim-fraction {fraction:g} or more with {clients} clients a round"
        if fewest is not None:
            fix += f", or at least {fewest} clients a round"
    raise UserError(
        f"--aggregator trimmed-mean cuts floor({trim_fraction:g} x {clients}) = 0 clients at each "
        f"end, i.e. it is the plain unweighted mean: use {fix}"
    )


def validate_critical_layer(config: ExperimentConfig, num_layers: int) -> int:
    """The critical layer as an int in 0..L ('half' is L // 2; None is L: plain FedAvg,
    everything global; FedBT's schedule: L)."""
    model_settings = config.model
    c = model_settings.critical_layer
    if config.federation.layer_schedule == "fedbt":  # one shared model: 'half' becomes L
        if c not in (HALF, None, num_layers):
            raise UserError(
                f"{as_given(config, 'layer_schedule')} trains one shared model, every layer "
                f"shared (c = L = {num_layers}), but {as_given(config, 'critical_layer')} keeps "
                f"the layers above {c} personal; "
                f"{drop(config, 'critical_layer', unset='--critical-layer L')} (docs/fedbt.md)"
            )
        c = None
    c = num_layers if c is None else num_layers // 2 if c == HALF else c
    if not 0 <= c <= num_layers:
        raise UserError(
            f"{as_given(config, 'critical_layer')} is outside 0..{num_layers} for model "
            f"{model_settings.name!r} ({num_layers} layers); pass --critical-layer with a value in "
            f"0..{num_layers}"
        )
    return c

"""What a run saves of its config and what a `--resume` compares: config.json's content (the
settings, and the server's learning rate and tau as they resolved) and the settings that differ
between a saved run and the config resuming it in a way that would change its results. The
simulation and the Flower server check their run directory (`check_run_dir`) and drive their run
(`drive`) with these alike.

Runs saved before a setting existed, or before the adaptive servers' defaults were tuned, still
resume: they ran at the defaults of their day (`_ADDED_LATER`, `_UNTUNED`).
"""

from __future__ import annotations

from typing import Any

from fedjax_split.fed.algorithms import ALGORITHMS
from fedjax_split.run import driver
from fedjax_split.run.config import FIELDS, SCHEMA, ExperimentConfig

# The adaptive servers' learning rate and tau before they were tuned (docs/fedopt_tuning.md): what
# a run saved without `server_settings` ran when it left --server-lr / --server-tau unset
_UNTUNED = {"server_lr": 1e-3, "server_tau": 1e-3}


def server_settings(config: ExperimentConfig) -> dict[str, float | None]:
    """The server's learning rate and tau as the run uses them (the registry's where unset),
    saved in config.json beside the flags, so that a --resume after a default changes is caught."""
    federation = config.federation
    algorithm = ALGORITHMS[federation.algorithm]
    tau = federation.server_tau if federation.server_tau is not None else algorithm.tau
    return {"server_lr": federation.effective_server_lr, "server_tau": tau}


def saved_dict(config: ExperimentConfig) -> dict[str, Any]:
    """config.json's content: the settings and the server settings they resolve to."""
    return {**config.to_dict(), "server_settings": server_settings(config)}


def _saved_server(saved: dict[str, Any]) -> dict[str, float | None] | None:
    if "server_settings" in saved:
        return saved["server_settings"]
    algorithm = ALGORITHMS.get(saved.get("algorithm", ""))
    if algorithm is None:
        return None
    old = _UNTUNED if algorithm.adaptive else {"server_lr": algorithm.server_lr, "server_tau": None}
    return {k: saved.get(k) if saved.get(k) is not None else old[k] for k in old}


# settings added after runs were saved: such a run trained at their defaults
_ADDED_LATER = ("client_optimizer", "lr_schedule", "warmup_ratio", "client_clip_norm",
                "secure_aggregation")  # fmt: skip


def trajectory_mismatch(saved: dict[str, Any], config: ExperimentConfig) -> list[str]:
    """Names of settings that differ from a saved run and would change its results on --resume:
    the flags, and the server settings they resolved to (a default may have changed since)."""
    flags = {k: v for k, v in saved.items() if k not in ("server_lr", "server_tau")}
    # settings added after runs were saved without them: such a run trained at their defaults
    flags = {**{k: FIELDS[k].default for k in _ADDED_LATER}, **flags}
    names = SCHEMA.trajectory_mismatch(flags, config)  # the server's: as they resolve, below
    ran = _saved_server(saved)
    if ran is not None and ran != server_settings(config):
        tau = "" if ran["server_tau"] is None else f" --server-tau {ran['server_tau']:g}"
        names = sorted({*names, f"the server it ran: --server-lr {ran['server_lr']:g}{tau}"})
    return names


def check_run_dir(config: ExperimentConfig) -> None:
    """`driver.check_run_dir` for a fine-tuning run, before anything is written: `--resume` needs
    the saved run's trajectory settings (`trajectory_mismatch`) to be the config's."""
    driver.check_run_dir(config.run_dir, config.outputs.resume,
                         lambda saved: trajectory_mismatch(saved, config))  # fmt: skip


def drive(
    run: driver.Run,
    config: ExperimentConfig,
    *,
    progress: bool = True,
    on_round_end: driver.RoundHook | None = None,
) -> dict[str, Any]:
    """`driver.drive` for a fine-tuning run (the simulation's or the Flower server's): config.json
    is `saved_dict`'s, the checkpoints are as the config's outputs say; the summary."""
    outputs = config.outputs
    return driver.drive(
        run,
        saved_dict(config),
        resume=outputs.resume,
        checkpoint_every=outputs.checkpoint_every,
        keep_checkpoints=outputs.keep_checkpoints,
        progress=progress,
        on_round_end=on_round_end,
    )

"""A run's experiment configuration: `ExperimentConfig`, its schema, and `resolve_config`, which
resolves it from the defaults, a config file and the flags, and validates it.

`ExperimentConfig` holds one frozen section per concern, so that code reads
`config.federation.rounds` and a reader sees which settings a piece of code depends on; the
flags, config files and config.json keep each setting's flat name (`--rounds`). Each section is
written in its own module with the checks of its own values (run/data_section.py,
model_section.py, training_sections.py, privacy_section.py, runtime_sections.py); the rules
between sections are run/cross_checks.py's, and what a run saves and a `--resume` compares is
run/saved_config.py's; the seed, --config and the run directory, which `pretrain`'s config
has too, are run/run_config.py's. The schema machinery (flags, config files, typing, choices,
resume checks) is `run.settings`, shared with `pretrain`'s config. Resolution order (later wins):
dataclass defaults -> `--config FILE` -> flags given explicitly on the command line. Every
problem a user can cause is a one-line `UserError`, raised before anything is written to the
output directory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.fed.algorithms import ALGORITHMS
from fedjax_split.run.cross_checks import check_across_sections
from fedjax_split.run.data_section import DataSettings
from fedjax_split.run.model_section import HALF, ModelSettings
from fedjax_split.run.privacy_section import PrivacySettings
from fedjax_split.run.run_config import NON_TRAJECTORY, RunConfig, check_sections
from fedjax_split.run.runtime_sections import OutputSettings, RuntimeSettings
from fedjax_split.run.settings import Schema, replaced, section
from fedjax_split.run.sites import implied_by_sites
from fedjax_split.run.training_sections import ClientSettings, FederationSettings

__all__ = [
    "ExperimentConfig", "FIELDS", "SCHEMA", "nullable", "resolve_config", "validate", "value_type",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(RunConfig):
    """Everything that defines a run. Defaults are the paper's setting (FedSplitBERT, Table III).

    Paper choices (MISSION.md section 1): bert-base-uncased, K=3 clients all taking part, Table I
    label partition, critical layer c=6 of 12 (the default is L/2 for any model, so a smaller
    model stays FedSplitBERT), inputs of 128 tokens. The paper tunes lr in {2,3,4,5}e-5, local
    epochs in 3..9 and batch in {8,16,32}; we default to the cheapest end that is standard for
    BERT fine-tuning (lr 2e-5, 3 local epochs, batch 16) and 10 rounds (Table VI's FedAvg needs 6
    rounds to reach 84% on MRPC; Table V uses 3 to 9).
    """

    data: DataSettings = section(DataSettings)
    model: ModelSettings = section(ModelSettings)
    client: ClientSettings = section(ClientSettings)
    federation: FederationSettings = section(FederationSettings)
    privacy: PrivacySettings = section(PrivacySettings)
    runtime: RuntimeSettings = section(RuntimeSettings)
    outputs: OutputSettings = section(OutputSettings)

    @property
    def poisson_sampling(self) -> bool:
        """DP with fewer clients a round than K: each client takes part independently with
        probability M/K (Poisson sampling, what the accountant's amplification assumes)."""
        return self.privacy.dp and self.federation.sampled_clients < self.federation.clients

    @property
    def prox_mu(self) -> float:
        """FedProx's proximal weight; the other algorithms train the plain client loss."""
        return self.client.mu if ALGORITHMS[self.federation.algorithm].prox else 0.0

    def run_name(self) -> str:
        model, fed = self.model, self.federation
        c = "L" if model.critical_layer is None else model.critical_layer
        how = f"c{c}" if fed.layer_schedule == "none" else fed.layer_schedule
        if fed.layer_schedule != "none" and fed.cycle_factor is not None:
            how += str(fed.cycle_factor)
        if model.model_layers is not None:
            how += f"_l{model.model_layers}"
        method = f"{fed.algorithm}_{how}"
        return f"{self.data.task}_{method}_K{fed.clients}_s{self.seed}"


# Fields that do not change the trajectory of a run; everything else must match on --resume.
_NON_TRAJECTORY = {
    *NON_TRAJECTORY,
    "rounds",
    "keep_checkpoints",
    "chunk_size",
    "cpu_devices",
    "coordinator",  # how many processes run a round changes no result (docs/scaling.md)
    "num_processes",
    "process_id",
    "attention",  # the same attention by another kernel: rounding moves, as on another machine
    "dp_publish_clients",  # where the per-client figures are written, not what they are
}
SCHEMA = Schema(ExperimentConfig, _NON_TRAJECTORY)
FIELDS = SCHEMA.fields
value_type = SCHEMA.value_type
nullable = SCHEMA.nullable


def resolve_config(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """Defaults <- config-file values <- explicit overrides, then `validate`. With --site-data
    DIR0,DIR1,... and no --clients, the clients are the sites."""
    config = SCHEMA.resolve(file_values, implied_by_sites(file_values, overrides), validate)
    if config.federation.layer_schedule == "fedbt" and config.model.critical_layer == HALF:
        # FedBT shares the whole model: the default 'half' means L (as --critical-layer L
        # does), so a run resumed with either has the same settings
        config = replaced(config, critical_layer=None)
    return config


def validate(config: ExperimentConfig) -> None:
    """Checks that need no data or model: the choices, each section's own values (its `check`),
    then the rules between sections (`run.cross_checks`; `validate_critical_layer` there needs
    the model's depth)."""
    check_sections(SCHEMA, config)
    check_across_sections(config)

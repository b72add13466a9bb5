"""What `train`'s config (`run.config.ExperimentConfig`) and `pretrain`'s
(`run.pretrain_config.PretrainConfig`) share: the seed, the --config file, the run's directory,
the checks each config starts with, the settings no run's results depend on."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fedjax_split.run.settings import TASK, Schema, Settings, value_of
from fedjax_split.run.settings import setting as _setting

# Settings that change no run's results, which a --resume may change: where it writes and how
# often it evaluates and saves, where its files are (what they hold is checked on its own).
NON_TRAJECTORY = (
    "output_dir", "resume", "config", "eval_every", "checkpoint_every", "data_dir", "model",
    "site_data",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RunConfig(Settings):
    """A run's settings: the seed and the config file here, the sections in each command's
    subclass, which names its runs' directories (`run_name`)."""

    seed: int = _setting(
        0,
        "The one seed of the run: every random draw follows from it (the data's subsample and "
        "split into clients, initialisation, masks, batches, dropout).",
        group=TASK,
        metavar="SEED",
    )
    config: str | None = _setting(
        None,
        "Python (get_config() -> dict; FILE.py:ARG calls get_config(ARG)) or JSON config "
        "file; flags given override it.",
        metavar="FILE",
    )

    def run_name(self) -> str:
        """The run's directory under runs/ without --output-dir: the settings that tell runs
        apart."""
        raise NotImplementedError(type(self).__name__)

    @property
    def run_dir(self) -> Path:
        """--output-dir, else runs/`run_name`."""
        output_dir = value_of(self, "output_dir")
        return Path("runs") / self.run_name() if output_dir is None else Path(output_dir)


def check_sections(schema: Schema, config: RunConfig) -> None:
    """What every config's `validate` checks first: the choices, then each section's own values
    (its `check`), in their order."""
    schema.check_choices(config)
    for f in dataclasses.fields(config):
        if f.metadata.get("section"):
            getattr(config, f.name).check(config)

"""Experiment configuration: one dataclass, config files, flag overrides, validation.

Resolution order (later wins): dataclass defaults -> `--config FILE` -> flags given explicitly on
the command line. A config file is either a Python file defining `get_config() -> dict` (big_vision
style, with the run command in its docstring) or a JSON object. Every problem a user can cause is a
one-line `UserError`, raised before anything is written to the output directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import runpy
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.fed.algorithms import ALGORITHMS

PARTITIONS = ("paper", "dirichlet", "quantity", "iid")
QUANTIZE = ("none", "fp16", "bf16")
DTYPES = ("float32", "bfloat16")  # model compute dtypes; parameters stay fp32
ATTENTIONS = ("xla", "cudnn")  # model.ATTENTION_IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Everything that defines a run. Defaults are the paper's setting (FedSplitBERT, Table III).

    Paper choices (MISSION.md section 1): bert-base-uncased, K=3 clients all taking part, Table I
    label partition, critical layer c=6, inputs of 128 tokens. The paper tunes lr in {2,3,4,5}e-5,
    local epochs in 3..9 and batch in {8,16,32}; we default to the cheapest end that is standard for
    BERT fine-tuning (lr 2e-5, 3 local epochs, batch 16) and 10 rounds (Table VI's FedAvg needs 6
    rounds to reach 84% on MRPC; Table V uses 3 to 9).
    """

    task: str = "sst2"
    model: str = "bert-base-uncased"
    data_dir: str | None = None
    algorithm: str = "fedavg"
    critical_layer: int | None = 6
    freeze: str | None = None
    clients: int = 3
    clients_per_round: int | None = None
    partition: str = "paper"
    alpha: float = 1.0
    beta: float = 1.0
    rounds: int = 10
    local_epochs: int = 3
    batch_size: int = 16
    lr: float = 2e-5
    mu: float = 0.01
    quantize: str = "none"
    max_length: int = 128
    max_examples: int | None = None
    seed: int = 0
    output_dir: str | None = None
    resume: bool = False
    config: str | None = None
    server_lr: float | None = None
    eval_every: int = 1
    checkpoint_every: int = 1
    chunk_size: int | None = None
    cpu_devices: int | None = None
    dtype: str = "float32"
    packing: bool = False
    attention: str = "xla"

    @property
    def sampled_clients(self) -> int:
        """Clients per round; None means all clients (the paper's cross-silo setting)."""
        return self.clients if self.clients_per_round is None else self.clients_per_round

    @property
    def effective_server_lr(self) -> float:
        return ALGORITHMS[self.algorithm].server_lr if self.server_lr is None else self.server_lr

    @property
    def prox_mu(self) -> float:
        """FedProx's proximal weight; the other algorithms train the plain client loss."""
        return self.mu if ALGORITHMS[self.algorithm].prox else 0.0

    @property
    def run_dir(self) -> Path:
        if self.output_dir is not None:
            return Path(self.output_dir)
        c = "L" if self.critical_layer is None else self.critical_layer
        return Path("runs") / f"{self.task}_{self.algorithm}_c{c}_K{self.clients}_s{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(ExperimentConfig)}

# Fields that do not change the trajectory of a run; everything else must match on --resume.
_NON_TRAJECTORY = {
    "output_dir",
    "resume",
    "config",
    "rounds",
    "eval_every",
    "checkpoint_every",
    "chunk_size",
    "cpu_devices",
    "attention",  # the same attention by another kernel: rounding moves, as on another machine
    "data_dir",
    "model",
}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a `.py` (defining `get_config() -> dict`) or `.json` config file into a plain dict."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} not found; pass an existing --config file")
    if p.suffix == ".json":
        try:
            values = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(
                f"config file {str(p)!r} is not valid JSON ({e}); fix the file"
            ) from None
    elif p.suffix == ".py":
        try:
            namespace = runpy.run_path(str(p))
        except Exception as e:  # noqa: BLE001 - any error in user code is a user error
            raise UserError(
                f"config file {str(p)!r} failed to run: {type(e).__name__}: {e}"
            ) from None
        get_config = namespace.get("get_config")
        if not callable(get_config):
            raise UserError(
                f"config file {str(p)!r} defines no get_config(); add one returning a dict"
            )
        values = get_config()
    else:
        raise UserError(f"config file {str(p)!r} must end in .py or .json")
    if not isinstance(values, dict):
        raise UserError(f"config file {str(p)!r} must give a dict of settings, got {type(values)}")
    return dict(values)


def _coerce(name: str, value: Any) -> Any:
    """Type-check one setting from a config file (flags are already typed by argparse)."""
    default = FIELDS[name].default
    if value is None:
        if default is None or name == "critical_layer":
            return None
        raise UserError(f"setting {name!r} cannot be null; give a value or leave it out")
    expected = type(default) if default is not None else None
    if name in ("critical_layer", "clients_per_round", "max_examples", "chunk_size", "cpu_devices"):
        expected = int
    elif name in ("server_lr",):
        expected = float
    elif name in ("data_dir", "output_dir", "config", "freeze"):
        expected = str
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool) or not isinstance(value, expected):
        raise UserError(
            f"setting {name!r} must be {expected.__name__}, got {value!r}; fix the config"
        )
    return value


def resolve_config(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """Defaults <- config-file values <- explicit overrides, then `validate`."""
    merged: dict[str, Any] = {}
    for source in (file_values or {}, overrides or {}):
        for name, value in source.items():
            if name not in FIELDS:
                known = ", ".join(FIELDS)
                raise UserError(f"unknown setting {name!r}; known settings: {known}")
            merged[name] = _coerce(name, value)
    config = ExperimentConfig(**merged)
    validate(config)
    return config


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        flag = "--" + name.replace("_", "-")
        raise UserError(f"unknown {name} {value!r}; pass {flag} one of: {', '.join(choices)}")


def validate(config: ExperimentConfig) -> None:
    """Checks that need no data or model; `validate_critical_layer` needs the model's depth."""
    _check_choice("algorithm", config.algorithm, tuple(ALGORITHMS))
    _check_choice("partition", config.partition, PARTITIONS)
    _check_choice("quantize", config.quantize, QUANTIZE)
    _check_choice("dtype", config.dtype, DTYPES)
    _check_choice("attention", config.attention, ATTENTIONS)
    if config.clients < 1:
        raise UserError(f"--clients must be at least 1, got {config.clients}")
    if config.clients_per_round is not None and not 1 <= config.clients_per_round <= config.clients:
        raise UserError(
            f"--clients-per-round must be in 1..{config.clients} (--clients), "
            f"got {config.clients_per_round}"
        )
    positive_ints = ("rounds", "local_epochs", "batch_size", "max_length", "eval_every")
    for name in positive_ints:
        if getattr(config, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be at least 1, got {getattr(config, name)}")
    for name in ("max_examples", "chunk_size", "cpu_devices"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if config.checkpoint_every < 0:
        raise UserError(
            f"--checkpoint-every must be >= 0 (0 = never), got {config.checkpoint_every}"
        )
    for name in ("lr", "alpha", "beta"):
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name} must be a positive number, got {value}")
    if config.server_lr is not None and not (
        math.isfinite(config.server_lr) and config.server_lr > 0
    ):
        raise UserError(f"--server-lr must be a positive number, got {config.server_lr}")
    if not (math.isfinite(config.mu) and config.mu >= 0):
        raise UserError(f"--mu must be >= 0, got {config.mu}")
    if config.critical_layer is not None and config.critical_layer < 0:
        raise UserError(
            f"--critical-layer must be in 0..L (L = the model's layers), got "
            f"{config.critical_layer}"
        )
    if config.freeze is not None:
        try:
            re.compile(config.freeze)
        except re.error as e:
            raise UserError(
                f"--freeze {config.freeze!r} is not a valid regex ({e}); pass a Python regex "
                r"over Hugging Face tensor names, e.g. 'embeddings\.'"
            ) from None
    if config.data_dir is not None and not Path(config.data_dir).is_dir():
        raise UserError(f"data dir {config.data_dir!r} does not exist; pass an existing --data-dir")


def validate_critical_layer(config: ExperimentConfig, num_layers: int) -> int:
    """The critical layer as an int in 0..L (None means L: plain FedAvg, everything global)."""
    c = num_layers if config.critical_layer is None else config.critical_layer
    if not 0 <= c <= num_layers:
        raise UserError(
            f"--critical-layer {c} is outside 0..{num_layers} for model {config.model!r} "
            f"({num_layers} layers); pass a value in 0..{num_layers}"
        )
    return c


def trajectory_mismatch(saved: dict[str, Any], config: ExperimentConfig) -> list[str]:
    """Names of settings that differ from a saved run and would change its results on --resume."""
    current = config.to_dict()
    return sorted(
        k for k in current if k not in _NON_TRAJECTORY and k in saved and saved[k] != current[k]
    )

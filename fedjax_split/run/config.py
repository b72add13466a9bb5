"""Experiment configuration: sections, config files, flag overrides, validation.

A run's `ExperimentConfig` holds one frozen section per concern (data, model, client,
federation, privacy, runtime, outputs), so that code reads `config.federation.rounds` and a
reader sees which settings a piece of code depends on; the flags, config files and config.json
keep each setting's flat name (`--rounds`). The schema machinery (flags, config files, typing,
choices, resume checks) is `run.settings`, shared with `pretrain`'s config. Resolution order
(later wins): dataclass defaults -> `--config FILE` -> flags given explicitly on the command
line. Every problem a user can cause is a
one-line `UserError`, raised before anything is written to the output directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedjax_split.errors import UserError
from fedjax_split.fed.algorithms import ALGORITHMS, check_tau
from fedjax_split.run.settings import (
    DEPLOYMENT,
    FEDERATION,
    MODEL,
    OUTPUTS,
    PERFORMANCE,
    PRIVACY,
    TASK,
    Schema,
    Section,
    Settings,
    as_given,
    drop,
    flag_name,
    load_config_file,
    optional_int,
    origin,
    replaced,
    section,
    value_of,
)
from fedjax_split.run.settings import setting as _setting

if TYPE_CHECKING:  # models.lora imports JAX: the flags' modules import none
    from fedjax_split.models.lora import LoraSettings

__all__ = [
    "ExperimentConfig", "FIELDS", "NODE_SITES", "SCHEMA", "check_site_dirs", "entity_type_list",
    "load_config_file", "nullable", "refuse_with_sites", "resolve_config", "site_dirs",
    "trajectory_mismatch", "validate", "validate_critical_layer", "value_type",
]  # fmt: skip

PARTITIONS = ("paper", "dirichlet", "quantity", "iid")
PAPER_FILLS = ("exact", "sequential")  # data.partition.FILLS
QUANTIZE = ("none", "fp16", "bf16")
DTYPES = ("float32", "bfloat16")  # model compute dtypes; parameters stay fp32
ATTENTIONS = ("xla", "cudnn")  # model.ATTENTION_IMPLEMENTATIONS
AGGREGATORS = ("mean", "trimmed-mean", "median")  # fed.aggregation.RULES
ACCOUNTANTS = ("rdp", "pld")  # fed.accounting
ATTACKS = ("none", "scale", "sign-flip")
LAYER_SCHEDULES = ("none", "fedbt")
CLIENT_OPTIMIZERS = ("adamw", "sgd")  # fed.client.client_optimizer's names
LR_SCHEDULES = ("constant", "linear")


_TASK_KINDS = {"glue": "a GLUE task", "offline": "an offline corpus", "ner": "a NER task"}


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


def _task_help() -> str:
    """--task's help, listing every registered task by kind. The registry imports jax, so it is
    imported when the flags are built, after the entry point has tuned the process."""
    from fedjax_split.tasks.registry import TASKS

    kinds: dict[str, list[str]] = {}
    for task in TASKS.values():
        kinds.setdefault(task.kind, []).append(task.name)
    parts = [f"{_TASK_KINDS.get(k, k)} ({', '.join(names)})" for k, names in kinds.items()]
    listed = f"{', '.join(parts[:-1])} or {parts[-1]}" if len(parts) > 1 else parts[0]
    return f"Task: {listed}."


HALF = "half"  # --critical-layer's default: half the model's layers, whatever the model


def critical_layer_value(text: str) -> int | str | None:
    """--critical-layer's values: 'half' (L/2), or what `optional_int` reads: an integer, or
    'L'/'all' (None: every layer)."""
    if text.strip().lower() == HALF:
        return HALF
    try:
        return optional_int(text.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, 'half' or 'L' for the critical layer, got {text!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class DataSettings(Section):
    """The task and its data: where the examples come from, how the pool is split into clients."""

    task: str = _setting("sst2", _task_help, group=TASK, metavar="TASK")
    data_dir: str | None = _setting(
        None,
        "Directory with the task's local files (GLUE TSV/parquet, CoNLL for ner); unset: the hub "
        "or the offline asset.",
        metavar="DIR",
        group=TASK,
    )
    site_data: str | None = _setting(
        None,
        "Sites with their own data: DIR0,DIR1,... one directory per client, each in a format "
        "--data-dir reads (GLUE TSV/parquet, an offline corpus's file, CoNLL for a token task, "
        "whose tags are checked against the task's entity types or --entity-types): client k "
        "trains on DIR_k's train file and tests on its dev (and test) file (else 80/20 of "
        "its train file); no pool and no partition, so the sites are the clients and the "
        "partition flags and --max-examples do not apply. On Flower (python -m "
        "fedjax_split.flower) SuperNode k reads DIR_k alone; `node-config`: each SuperNode reads "
        "the data-dir of its own node config (real sites with --write-app, docs/deployment.md).",
        metavar="DIRS",
        group=TASK,
    )
    entity_types: str | None = _setting(
        None,
        "A token task's entity types, TYPE1,TYPE2,...: its tags are O and B-/I- of each, a tag "
        "outside them stops the run naming its file and line. Needed by `ner` with --site-data "
        "(no site's tags decide the vocabulary); the offline corpora (wnut16, nero) have their "
        "own; unset for a `ner` pool: the pool's own tags.",
        metavar="TYPES",
        group=TASK,
    )
    partition: str = _setting(
        "paper",
        "How examples are split over clients: the paper's label shares, Dirichlet label skew, "
        "Dirichlet quantity skew, or IID.",
        choices=PARTITIONS,
        group=TASK,
    )
    paper_fill: str = _setting(
        "exact",
        "--partition paper: 'exact' gives every client its row's label shares exactly (all clients "
        "the largest size at which every row is feasible, the surplus left out and reported); "
        "'sequential' gives each |D|/K examples filled in client order, so on skewed pools the "
        "last clients miss their shares.",
        choices=PAPER_FILLS,
        group=TASK,
    )
    alpha: float = _setting(
        1.0,
        "Dirichlet concentration for --partition dirichlet (small = more skewed).",
        group=TASK,
        metavar="ALPHA",
    )
    beta: float = _setting(
        1.0,
        "Dirichlet concentration of client sizes for --partition quantity.",
        group=TASK,
        metavar="BETA",
    )
    max_length: int = _setting(
        128, "Tokens per input after truncation.", group=TASK, metavar="TOKENS"
    )
    max_examples: int | None = _setting(
        None,
        "Subsample the task to this many examples before partitioning (quick runs).",
        metavar="N",
        group=TASK,
    )


@dataclasses.dataclass(frozen=True)
class ModelSettings(Section):
    """The model and what of it is shared: the checkpoint, its depth, the critical layer, frozen
    parameters, LoRA adapters."""

    name: str = _setting(
        "bert-base-uncased",
        "Hugging Face model id, local HF-format directory, or the offline alias 'minilm-l6'.",
        group=MODEL,
        metavar="MODEL",
        key="model",
    )
    model_layers: int | None = _setting(
        None,
        "Keep only the first LAYERS encoder layers of the pretrained model (a truncated model: the "
        "shallow baselines of FedBT's Table 3, as DistilBERT or TinyBERT's depth); unset: all.",
        metavar="LAYERS",
        group=MODEL,
    )
    critical_layer: int | str | None = _setting(
        HALF,
        "Layers 1..c (and embeddings) are global, the rest and the head local per client "
        "(FedSplitBERT); 'half' = L/2 for the model's L layers (the paper's 6 of 12), 'L' = all "
        "global (plain FedAvg), 0 = no sharing.",
        metavar="C",
        parse=critical_layer_value,
        group=MODEL,
    )
    freeze: str | None = _setting(
        None,
        "Regex over Hugging Face tensor names (re.search): matching parameters are frozen, neither "
        "trained nor sent, whatever --critical-layer says; e.g. 'embeddings\\.' or "
        "'embeddings\\.|encoder\\.layer\\.[0-2]\\.'.",
        metavar="REGEX",
        group=MODEL,
    )
    lora_rank: int | None = _setting(
        None,
        "LoRA adapters of this rank on the layers --lora-targets names: the base weights are "
        "frozen and only the adapters and the head train; adapters below the critical layer are "
        "shared, those above and the head personal (docs/lora.md). Unset: no LoRA.",
        metavar="R",
        group=MODEL,
    )
    lora_alpha: float | None = _setting(
        None,
        "LoRA: the scale's numerator, updates scaled by alpha / r (unset: 2r).",
        metavar="A",
        group=MODEL,
    )
    lora_targets: str = _setting(
        "query|value",
        "LoRA: regex (re.search) over the encoder's dense layers by their PEFT module names, e.g. "
        "'bert.encoder.layer.0.attention.self.query'; the default is PEFT's for BERT, the "
        "attention's query and value ('query|key|value|dense' takes every dense layer).",
        metavar="REGEX",
        group=MODEL,
    )
    lora_dropout: float = _setting(
        0.0, "LoRA: dropout on the adapters' input (PEFT's default 0).", group=MODEL, metavar="P"
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


@dataclasses.dataclass(frozen=True)
class PrivacySettings(Section):
    """Privacy and robustness: the server's aggregation rule, client-level DP, secure
    aggregation, and the simulated attacker of the robustness studies."""

    aggregator: str = _setting(
        "mean",
        "How the server combines the clients' updates: mean (example-weighted, FedAvg's), or "
        "coordinate-wise trimmed-mean or median over the clients (unweighted; robust to a few "
        "bad clients).",
        choices=AGGREGATORS,
        group=PRIVACY,
    )
    trim_fraction: float = _setting(
        0.1,
        "--aggregator trimmed-mean: the fraction of clients cut at each end, per coordinate: "
        "floor(fraction x M) of M clients a round, which must be at least 1 (0.1 needs 10).",
        group=PRIVACY,
        metavar="FRACTION",
    )
    max_update_norm: float | None = _setting(
        None, "Clip each client's update of the global part to this L2 norm (no noise).",
        metavar="NORM", group=PRIVACY,
    )  # fmt: skip
    dp_noise_multiplier: float | None = _setting(
        None,
        "Client-level differential privacy: Gaussian noise of this many times --dp-clip on the "
        "sum of the clients' clipped updates of the global part, then a uniform mean (the local "
        "part gets none: it never leaves a client). docs/privacy.md.",
        metavar="Z",
        group=PRIVACY,
    )
    dp_clip: float | None = _setting(
        None, "DP: each client's update of the global part is clipped to this L2 norm.",
        metavar="C", group=PRIVACY,
    )  # fmt: skip
    dp_clip_quantile: float | None = _setting(
        None,
        "DP: adaptive clipping (Andrew et al. 2021): the clip norm follows this quantile of the "
        "clients' update norms, starting at --dp-clip.",
        metavar="Q",
        group=PRIVACY,
    )
    dp_delta: float = _setting(
        1e-5, "DP: the delta of the (epsilon, delta) reported.", group=PRIVACY, metavar="DELTA"
    )
    dp_accountant: str = _setting(
        "rdp",
        "DP: the accountant (Google's dp_accounting): rdp or pld.",
        choices=ACCOUNTANTS,
        group=PRIVACY,
    )
    dp_max_epsilon: float | None = _setting(
        None, "DP: stop before the round that would take epsilon past this budget.",
        metavar="EPS", group=PRIVACY,
    )  # fmt: skip
    dp_insecure_reproducible_noise: bool = _setting(
        False,
        "DP: draw the server's noise and client sample from --seed, not from a secret, so that "
        "a run can be repeated noise for noise (tests, studies). Anyone who knows the seed can "
        "then remove the noise: no privacy guarantee holds, and the run says so.",
        group=PRIVACY,
    )
    dp_publish_clients: bool = _setting(
        False,
        "DP: write each client's figures (sampled clients, update norms, losses, metrics) to "
        "metrics.jsonl and summary.json as without DP; the guarantee does not cover them. By "
        "default they go to the server-private private/clients.jsonl only.",
        group=PRIVACY,
    )
    secure_aggregation: bool = _setting(
        False,
        "Secure aggregation (SecAgg+): the server learns only the sum of the clients' updates, "
        "fixed-point in 64 bits (Flower: masked by the sites; the simulation models the same "
        "sums). Clients are trained one at a time. docs/deployment.md.",
        group=PRIVACY,
    )
    attack: str = _setting(
        "none",
        "A study's attack (simulation only): --attack-fraction of the clients upload their "
        "update scaled by --attack-scale, or sign-flipped.",
        choices=ATTACKS,
        group=PRIVACY,
    )
    attack_fraction: float = _setting(
        0.1, "--attack: the fraction of clients that attack.", group=PRIVACY, metavar="FRACTION"
    )
    attack_scale: float = _setting(
        100.0,
        "--attack scale: the factor on the attackers' updates.",
        group=PRIVACY,
        metavar="FACTOR",
    )

    @property
    def dp(self) -> bool:
        """Whether client-level DP is on."""
        return self.dp_noise_multiplier is not None


@dataclasses.dataclass(frozen=True)
class RuntimeSettings(Section):
    """How the run uses the machine: devices, processes, compute dtype, batch shapes, kernels;
    none of it changes what a run computes beyond rounding."""

    chunk_size: int | None = _setting(
        None,
        "Clients trained at once, which picks how a round runs. 1: one at a time, each with its "
        "own programs, as a Flower client trains (a CPU's default; --cpu-devices deals them "
        "over devices). N > 1: the accelerator path: the clients' steps stacked and N clients "
        "vmapped at once on one device (N at least the round's clients: all at once, an "
        "accelerator's default); memory grows with N.",
        group=PERFORMANCE,
        metavar="N",
    )
    cpu_devices: int | None = _setting(
        None,
        "CPU devices that clients trained one at a time are dealt to, each running its clients "
        "while the others run theirs (default 1): two streams of small ops keep the cores "
        "busier, but every program compiles once per device, so it pays in long runs with many "
        "clients (docs/benchmarks.md measures it). Results do not depend on it.",
        metavar="N",
        group=PERFORMANCE,
    )
    dtype: str = _setting(
        "float32",
        "Compute dtype of the model (parameters stay float32).",
        choices=DTYPES,
        group=PERFORMANCE,
    )
    packing: bool = _setting(
        True,
        "Pack each batch's examples end to end into one token stream instead of padding each to "
        "the longest: no padding is computed whatever the mix of lengths (docs/benchmarks.md). "
        "--no-packing pads each batch to its longest example.",
        group=PERFORMANCE,
    )
    bucketing: bool = _setting(
        False,
        "Sort examples by length inside windows of 200 batches before cutting batches (less "
        "padding without packing), instead of Algorithm 1's plain random mini-batches; batches "
        "then repeat their membership across epochs.",
        group=PERFORMANCE,
    )
    attention: str = _setting(
        "xla",
        "Attention kernel: xla (default, anywhere) or cudnn (jax's fused cuDNN attention; GPU "
        "with --dtype bfloat16; evaluation only, training keeps xla's).",
        choices=ATTENTIONS,
        group=PERFORMANCE,
    )
    coordinator: str | None = _setting(
        None,
        "One simulation over several processes (JAX's distributed runtime): HOST:PORT of "
        "process 0, the same for every process (unset: JAX_COORDINATOR_ADDRESS, if set). Every "
        "process needs --output-dir on a filesystem they all see (docs/scaling.md).",
        metavar="HOST:PORT",
        group=DEPLOYMENT,
    )
    num_processes: int | None = _setting(
        None,
        "Processes of a multi-process simulation (unset: 1, or what SLURM / Open MPI say when "
        "a coordinator is given); the sampled clients are dealt over every device of every "
        "process, one at a time on each, and the results equal one process's that trains them "
        "one at a time (a CPU's default) bit for bit.",
        metavar="N",
        group=DEPLOYMENT,
    )
    process_id: int | None = _setting(
        None,
        "This process's index, 0..N-1 (0 writes the run directory).",
        metavar="I",
        group=DEPLOYMENT,
    )


@dataclasses.dataclass(frozen=True)
class OutputSettings(Section):
    """Where the run writes and how often: its directory, evaluations, checkpoints."""

    output_dir: str | None = _setting(
        None,
        "Run directory for metrics.jsonl, summary.json, config.json, partition.json and "
        "checkpoints/ (unset: runs/<task>_<algorithm>_c<c>_K<K>_s<seed>).",
        metavar="DIR",
        group=OUTPUTS,
    )
    resume: bool = _setting(
        False, "Continue the run in --output-dir from its latest checkpoint.", group=OUTPUTS
    )
    eval_every: int = _setting(
        1,
        "Evaluate the personalised models every N rounds (and after the last).",
        group=OUTPUTS,
        metavar="N",
    )
    checkpoint_every: int = _setting(
        1,
        "Save a checkpoint every N rounds (and after the last); 0 = never.",
        group=OUTPUTS,
        metavar="N",
    )
    keep_checkpoints: int = _setting(
        2,
        "How many of the latest checkpoints stay on disk, with the client-store versions they "
        "need (at least 1); --resume and export read the latest.",
        metavar="N",
        group=OUTPUTS,
    )


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(Settings):
    """Everything that defines a run. Defaults are the paper's setting (FedSplitBERT, Table III).

    Paper choices (MISSION.md section 1): bert-base-uncased, K=3 clients all taking part, Table I
    label partition, critical layer c=6 of 12 (the default is L/2 for any model, so a smaller
    model stays FedSplitBERT), inputs of 128 tokens. The paper tunes lr in {2,3,4,5}e-5, local
    epochs in 3..9 and batch in {8,16,32}; we default to the cheapest end that is standard for
    BERT fine-tuning (lr 2e-5, 3 local epochs, batch 16) and 10 rounds (Table VI's FedAvg needs 6
    rounds to reach 84% on MRPC; Table V uses 3 to 9).
    """

    seed: int = _setting(
        0,
        "The one seed of the run (data subsample, partition, init, batches, dropout).",
        group=TASK,
        metavar="SEED",
    )
    config: str | None = _setting(
        None,
        "Python (get_config() -> dict; FILE.py:ARG calls get_config(ARG)) or JSON config "
        "file; flags given override it.",
        metavar="FILE",
    )
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

    @property
    def run_dir(self) -> Path:
        if self.outputs.output_dir is not None:
            return Path(self.outputs.output_dir)
        model, fed = self.model, self.federation
        c = "L" if model.critical_layer is None else model.critical_layer
        how = f"c{c}" if fed.layer_schedule == "none" else fed.layer_schedule
        if fed.layer_schedule != "none" and fed.cycle_factor is not None:
            how += str(fed.cycle_factor)
        if model.model_layers is not None:
            how += f"_l{model.model_layers}"
        method = f"{fed.algorithm}_{how}"
        return Path("runs") / f"{self.data.task}_{method}_K{fed.clients}_s{self.seed}"


# Fields that do not change the trajectory of a run; everything else must match on --resume.
_NON_TRAJECTORY = {
    "output_dir",
    "resume",
    "config",
    "rounds",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "chunk_size",
    "cpu_devices",
    "coordinator",  # how many processes run a round changes no result (docs/scaling.md)
    "num_processes",
    "process_id",
    "attention",  # the same attention by another kernel: rounding moves, as on another machine
    "data_dir",
    "site_data",  # where the sites' files are (the partition check covers what they hold)
    "model",
    "dp_publish_clients",  # where the per-client figures are written, not what they are
}
SCHEMA = Schema(ExperimentConfig, _NON_TRAJECTORY)
FIELDS = SCHEMA.fields
value_type = SCHEMA.value_type
nullable = SCHEMA.nullable


NODE_SITES = "node-config"  # --site-data's value for real sites: each node's own data-dir


def resolve_config(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """Defaults <- config-file values <- explicit overrides, then `validate`. With --site-data
    DIR0,DIR1,... and no --clients, the clients are the sites."""
    given = {**(file_values or {}), **(overrides or {})}
    sites = given.get("site_data")
    if isinstance(sites, str) and sites != NODE_SITES and "clients" not in given:
        overrides = {**(overrides or {}), "clients": len(sites.split(","))}
    config = SCHEMA.resolve(file_values, overrides, validate)
    if config.federation.layer_schedule == "fedbt" and config.model.critical_layer == HALF:
        # FedBT shares the whole model: the default 'half' means L (as --critical-layer L
        # does), so a run resumed with either has the same settings
        config = replaced(config, critical_layer=None)
    return config


def site_dirs(config: Any) -> list[Path]:
    """--site-data's directories (train's or pretrain's config), client k's at k ([] without
    --site-data or with `node-config`, where each node knows its own)."""
    if config.data.site_data is None or config.data.site_data == NODE_SITES:
        return []
    return [Path(d.strip()).expanduser() for d in config.data.site_data.split(",")]


# settings that draw a partition from a pool: with --site-data there is none to draw
_POOL_ONLY = ("partition", "paper_fill", "alpha", "beta", "max_examples", "data_dir")


def validate_sites(config: ExperimentConfig) -> None:
    """--site-data: one existing directory per client, none named twice, and none of the
    settings that subsample or partition a pool (they would be silently ignored)."""
    if config.data.site_data is None:
        return
    refuse_with_sites(config, _POOL_ONLY, FIELDS, "data are its own site's files, not drawn "
                      "from a pool", "partition one pool")  # fmt: skip
    check_site_dirs(config)


def refuse_with_sites(
    config: Any, names: tuple[str, ...], fields: Any, what: str, instead: str
) -> None:
    """UserError naming the first of `names` set to other than its default (`fields`: the
    schema's) in a --site-data run, where it would be silently ignored: "each client's
    {what}", "drop --site-data to {instead}"."""
    given = [n for n in names if value_of(config, n) != fields[n].default]
    if given:
        raise UserError(f"{as_given(config, given[0])} with --site-data: each client's {what}; "
                        f"{drop(config, given[0])} (or drop --site-data to {instead})")  # fmt: skip


def check_site_dirs(config: Any) -> None:
    """--site-data DIR0,DIR1,... of train's or pretrain's config: one existing directory per
    client, none empty or named twice (`node-config`: nothing to check here)."""
    data_cfg = config.data
    if data_cfg.site_data is None or data_cfg.site_data == NODE_SITES:
        return
    texts = [d.strip() for d in data_cfg.site_data.split(",")]
    if not all(texts):
        raise UserError(
            f"--site-data {data_cfg.site_data!r} has an empty entry; pass DIR0,DIR1,... with one "
            "directory per client"
        )
    dirs = site_dirs(config)
    if config.federation.clients != len(dirs):
        raise UserError(
            f"{as_given(config, 'clients')} but --site-data names {len(dirs)} sites; "
            f"{drop(config, 'clients', unset=f'--clients {len(dirs)}')} (each site is one "
            "client)"
        )
    seen: dict[Path, int] = {}
    for k, d in enumerate(dirs):
        if not d.is_dir():
            raise UserError(f"--site-data: site {k}'s directory {str(d)!r} does not exist")
        first = seen.setdefault(d.resolve(), k)
        if first != k:
            raise UserError(f"--site-data names {str(d)!r} twice (sites {first} and {k}); "
                            "give each site its own directory")  # fmt: skip


def entity_type_list(config: ExperimentConfig) -> tuple[str, ...] | None:
    """--entity-types as sorted types (None when unset); a UserError for an empty entry, a
    duplicate, a space (CoNLL columns are split on spaces) or a tag given for a type."""
    if config.data.entity_types is None:
        return None
    types = [t.strip() for t in config.data.entity_types.split(",")]
    for t in types:
        if not t or any(c.isspace() for c in t) or t == "O" or t[:2] in ("B-", "I-"):
            raise UserError(
                f"--entity-types {config.data.entity_types!r}: {t!r} is not an entity type; pass "
                "TYPE1,TYPE2,... (e.g. PER,LOC,ORG: the tags are O and B-/I- of each)"
            )
    twice = sorted({t for t in types if types.count(t) > 1})
    if twice:
        raise UserError(f"--entity-types names {twice[0]!r} twice; name each type once")
    return tuple(sorted(types))


def validate(config: ExperimentConfig) -> None:
    """Checks that need no data or model; `validate_critical_layer` needs the model's depth."""
    federation_cfg, client_cfg = config.federation, config.client
    model_cfg, data_cfg = config.model, config.data
    SCHEMA.check_choices(config)
    if federation_cfg.clients < 1:
        raise UserError(f"--clients must be at least 1, got {_got(config, 'clients')}")
    per_round = federation_cfg.clients_per_round
    if per_round is not None and not 1 <= per_round <= federation_cfg.clients:
        raise UserError(
            f"--clients-per-round must be in 1..{federation_cfg.clients}, got "
            f"{_got(config, 'clients_per_round')}; {as_given(config, 'clients')} sets the clients"
        )
    positive_ints = ("rounds", "local_epochs", "batch_size", "max_length", "eval_every",
                     "keep_checkpoints")  # fmt: skip
    for name in positive_ints:
        if value_of(config, name) < 1:
            raise UserError(f"{flag_name(name)} must be at least 1, got {_got(config, name)}")
    for name in ("max_examples", "chunk_size", "cpu_devices", "model_layers"):
        value = value_of(config, name)
        if value is not None and value < 1:
            raise UserError(f"{flag_name(name)} must be at least 1, got {_got(config, name)}")
    if config.outputs.checkpoint_every < 0:
        raise UserError(
            f"--checkpoint-every must be >= 0 (0 = never), got {_got(config, 'checkpoint_every')}"
        )
    for name in ("lr", "alpha", "beta"):
        value = value_of(config, name)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{name} must be a positive number, got {_got(config, name)}")
    if federation_cfg.server_lr is not None and not (
        math.isfinite(federation_cfg.server_lr) and federation_cfg.server_lr > 0
    ):
        raise UserError(f"--server-lr must be a positive number, got {_got(config, 'server_lr')}")
    _positive(config, "server_tau")
    check_tau(federation_cfg.algorithm, federation_cfg.server_tau)
    if not (math.isfinite(client_cfg.mu) and client_cfg.mu >= 0):
        raise UserError(f"--mu must be >= 0, got {_got(config, 'mu')}")
    if isinstance(model_cfg.critical_layer, str) and model_cfg.critical_layer != HALF:
        raise UserError(
            f"--critical-layer must be an integer, 'half' or 'L', got "
            f"{model_cfg.critical_layer!r}{origin(config, 'critical_layer')}"
        )
    if isinstance(model_cfg.critical_layer, int) and model_cfg.critical_layer < 0:
        raise UserError(
            f"--critical-layer must be in 0..L (L = the model's layers), got "
            f"{_got(config, 'critical_layer')}"
        )
    if model_cfg.freeze is not None:
        try:
            re.compile(model_cfg.freeze)
        except re.error as e:
            raise UserError(
                f"{as_given(config, 'freeze')} is not a valid regex ({e}); pass a Python regex "
                r"over Hugging Face tensor names, e.g. 'embeddings\.'"
            ) from None
    validate_lora(config)
    validate_schedule(config)
    validate_client_optimizer(config)
    validate_processes(config)
    if data_cfg.data_dir is not None and not Path(data_cfg.data_dir).is_dir():
        raise UserError(f"data dir {data_cfg.data_dir!r}{origin(config, 'data_dir')} does not "
                        "exist; pass an existing --data-dir")  # fmt: skip
    validate_sites(config)
    entity_type_list(config)
    validate_aggregation(config)


def _got(config: Any, name: str) -> str:
    """A setting's value in an error, with where it came from: "0 (from configs/x.py)"."""
    return f"{value_of(config, name)}{origin(config, name)}"


def _positive(config: ExperimentConfig, name: str, zero_ok: bool = False) -> None:
    value = value_of(config, name)
    if value is not None and not (math.isfinite(value) and (value > 0 or zero_ok and value == 0)):
        bound = ">= 0" if zero_ok else "> 0"
        raise UserError(f"{flag_name(name)} must be a number {bound}, got {_got(config, name)}")


def lora_settings(config: ExperimentConfig) -> LoraSettings | None:
    """The run's `models.lora.LoraSettings`, None without --lora-rank."""
    if config.model.lora_rank is None:
        return None
    from fedjax_split.models.lora import LoraSettings  # JAX: the flags' modules import none

    return LoraSettings(config.model.lora_rank, config.model.lora_alpha, config.model.lora_targets,
                        config.model.lora_dropout)  # fmt: skip


def validate_lora(config: ExperimentConfig) -> None:
    """The LoRA flags: the rank first, and the others only with it; their values by
    `models.lora.check_settings` (which the model's configuration runs too)."""
    if config.model.lora_rank is None:
        given = [n for n in ("lora_alpha", "lora_targets", "lora_dropout")
                 if value_of(config, n) != FIELDS[n].default]  # fmt: skip
        if given:
            raise UserError(f"{as_given(config, given[0])} needs --lora-rank R, the adapters' "
                            "rank (e.g. 8)")  # fmt: skip
        return
    from fedjax_split.models.lora import check_settings  # JAX, as above

    check_settings(lora_settings(config))


def validate_schedule(config: ExperimentConfig) -> None:
    """--layer-schedule and --cycle-factor: the factor only with FedBT, at least 1 (at most L
    is checked with the model); FedBT trains whole layers, so no LoRA (its one shared model:
    `validate_critical_layer`)."""
    if config.federation.layer_schedule == "none":
        if config.federation.cycle_factor is not None:
            raise UserError(f"{as_given(config, 'cycle_factor')} needs --layer-schedule fedbt")
        return
    if config.federation.cycle_factor is not None and config.federation.cycle_factor < 1:
        raise UserError(f"--cycle-factor must be at least 1, got {_got(config, 'cycle_factor')}")
    if config.model.lora_rank is not None:
        raise UserError(
            f"{as_given(config, 'layer_schedule')} trains whole layers, not LoRA adapters "
            f"({as_given(config, 'lora_rank')}): "
            f"{drop(config, 'lora_rank', unset='--lora-rank none')}, or "
            f"{drop(config, 'layer_schedule')}"
        )


def validate_client_optimizer(config: ExperimentConfig) -> None:
    """--warmup-ratio in [0, 1) and only with the linear schedule; --client-clip-norm > 0."""
    _positive(config, "client_clip_norm")
    if not (math.isfinite(config.client.warmup_ratio) and 0 <= config.client.warmup_ratio < 1):
        raise UserError(f"--warmup-ratio must be in [0, 1), got {_got(config, 'warmup_ratio')}")
    if config.client.warmup_ratio and config.client.lr_schedule != "linear":
        raise UserError(f"{as_given(config, 'warmup_ratio')} needs --lr-schedule linear (the "
                        "constant rate has no warm-up)")  # fmt: skip


def validate_processes(config: ExperimentConfig) -> None:
    """The multi-process flags: a count of at least 1, an index inside it, one-at-a-time clients
    (several processes deal single clients to their devices; a vmapped chunk spans no process)."""
    n, i = config.runtime.num_processes, config.runtime.process_id
    if n is not None and n < 1:
        raise UserError(f"--num-processes must be at least 1, got {_got(config, 'num_processes')}")
    if i is not None and not 0 <= i < (n or 1):
        raise UserError(f"--process-id must be in 0..{(n or 1) - 1} (--num-processes), got "
                        f"{_got(config, 'process_id')}")  # fmt: skip
    check_chunk_size(config.runtime.chunk_size, n or 1)


def check_chunk_size(chunk_size: int | None, processes: int) -> None:
    """Several processes deal single clients to their devices: a vmapped chunk would span
    processes. Checked from the flags, and again where JAX knows the count (SLURM may set it)."""
    if processes > 1 and chunk_size not in (None, 1):
        raise UserError(
            f"--chunk-size {chunk_size} with {processes} processes: several processes train one "
            "client at a time on each device; leave --chunk-size unset"
        )


def validate_aggregation(config: ExperimentConfig) -> None:
    """The server's aggregation, client-level DP and the attack: settings that go together."""
    privacy_cfg = config.privacy
    for name in ("max_update_norm", "dp_clip", "dp_max_epsilon", "attack_scale"):
        _positive(config, name)
    _positive(config, "dp_noise_multiplier", zero_ok=True)
    if not 0 <= privacy_cfg.trim_fraction < 0.5:
        raise UserError(f"--trim-fraction must be in [0, 0.5), got {_got(config, 'trim_fraction')}")
    if privacy_cfg.aggregator == "trimmed-mean" and not privacy_cfg.dp:  # with DP: refused below
        check_trimming(privacy_cfg.trim_fraction, config.federation.sampled_clients)
    if not 0 < privacy_cfg.dp_delta < 1:
        raise UserError(f"--dp-delta must be in (0, 1), got {_got(config, 'dp_delta')}")
    if not 0 < privacy_cfg.attack_fraction <= 1:
        raise UserError(
            f"--attack-fraction must be in (0, 1], got {_got(config, 'attack_fraction')}"
        )
    if privacy_cfg.secure_aggregation:
        _check_secure(config)
    dp_only = ("dp_clip", "dp_clip_quantile", "dp_max_epsilon", "dp_insecure_reproducible_noise",
               "dp_publish_clients")  # fmt: skip
    if not privacy_cfg.dp:
        given = [n for n in dp_only if value_of(config, n) not in (None, False)]
        if given:
            raise UserError(
                f"{as_given(config, given[0])} needs --dp-noise-multiplier (client-level DP); for "
                "clipping without noise use --max-update-norm"
            )
        return
    if privacy_cfg.dp_clip is None:
        raise UserError("--dp-noise-multiplier needs --dp-clip C, the clip norm of the updates")
    if privacy_cfg.aggregator != "mean":
        raise UserError(
            f"{as_given(config, 'aggregator')} with DP: the noise is calibrated to a sum of "
            "clipped updates; use --aggregator mean"
        )
    if privacy_cfg.dp_max_epsilon is not None and privacy_cfg.dp_noise_multiplier == 0:
        raise UserError("--dp-max-epsilon with --dp-noise-multiplier 0: no noise, no budget")
    from fedjax_split.run import safeguards  # JAX, as above

    safeguards.aggregator(config)  # the DP settings' own checks (the quantile, z < M/10, ...)


def _check_secure(config: ExperimentConfig) -> None:
    """What cannot work on a sum alone is refused before anything runs."""
    if config.privacy.aggregator != "mean":
        raise UserError(
            f"{as_given(config, 'aggregator')} with --secure-aggregation: a robust rule needs "
            "every upload side by side, and secure aggregation shows the server only their sum; "
            "use --aggregator mean (--max-update-norm still bounds each update: the clients clip "
            "their own)"
        )
    if config.privacy.attack != "none":
        raise UserError("--attack with --secure-aggregation: the simulated attack edits uploads "
                        "the server can no longer see; drop one of them")  # fmt: skip
    if config.runtime.chunk_size not in (None, 1):
        raise UserError(f"--chunk-size {config.runtime.chunk_size} with --secure-aggregation: each "
                        "client's upload is quantised on its own; leave it unset")  # fmt: skip
    if config.federation.sampled_clients < 2:
        raise UserError("--secure-aggregation needs at least 2 clients a round (the sum of one "
                        "is its update): raise --clients-per-round")  # fmt: skip


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
    model_cfg = config.model
    c = model_cfg.critical_layer
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
            f"{model_cfg.name!r} ({num_layers} layers); pass --critical-layer with a value in "
            f"0..{num_layers}"
        )
    return c


# The adaptive servers' learning rate and tau before they were tuned (docs/fedopt_tuning.md): what
# a run saved without `server_settings` ran when it left --server-lr / --server-tau unset
_UNTUNED = {"server_lr": 1e-3, "server_tau": 1e-3}


def server_settings(config: ExperimentConfig) -> dict[str, float | None]:
    """The server's learning rate and tau as the run uses them (the registry's where unset),
    saved in config.json beside the flags, so that a --resume after a default changes is caught."""
    federation_cfg = config.federation
    algorithm = ALGORITHMS[federation_cfg.algorithm]
    tau = federation_cfg.server_tau if federation_cfg.server_tau is not None else algorithm.tau
    return {"server_lr": federation_cfg.effective_server_lr, "server_tau": tau}


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


_ADDED_LATER = ("client_optimizer", "lr_schedule", "warmup_ratio", "client_clip_norm",
                "secure_aggregation")


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

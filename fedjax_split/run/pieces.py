"""From a fine-tuning config to the model of a run: the checkpoint, its parameters by role (the
split at the critical layer, FedBT's cycle, what is frozen), the round's spec, the method's line,
the checkpoint's metadata and the run's summary.

Every execution path builds the model from these: the simulation (`run.experiment`), the Flower
server (`deploy.joining`) and each Flower node (`deploy.node`), so that all of them derive the same
model from the same config and seed; their data come from `run.client_data`. Nothing here writes
to the run directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.fed import algorithms, client, layerwise, roles
from fedjax_split.models import hf_checkpoint, lora
from fedjax_split.models.bert_config import BertConfig
from fedjax_split.run import plots, safeguards
from fedjax_split.run.client_data import entity_types, partition_lists
from fedjax_split.run.config import ExperimentConfig, validate
from fedjax_split.run.cross_checks import validate_critical_layer
from fedjax_split.run.method import client_words, describe
from fedjax_split.run.runtime_sections import check_chunk_size
from fedjax_split.run.value_checks import fits_positions
from fedjax_split.sim import devices, rounds
from fedjax_split.sim.round_spec import RoundSpec
from fedjax_split.tasks import registry as tasks

WIRE_DTYPE = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Model:
    """The model's pieces as the config makes them: the same on the server, in the simulation and
    on every node. `global0`, `local0`, `frozen`: the pretrained parameters by role (the head
    seeded by the run's seed)."""

    task: tasks.Task
    critical_layer: int
    config: BertConfig
    model_dir: Path | None
    apply: Callable[..., Any]
    round_spec: RoundSpec
    global0: Any
    local0: Any
    frozen: Any
    cycle_factor: int | None = None  # FedBT's cycle (--layer-schedule fedbt), else None

    def round_spec_for(self, r: int) -> Any:
        """Round r's spec: with FedBT's schedule it trains (and uploads) layers l..L-1 and the
        head only (`fed.layerwise.fedbt_trained`); every round's the same otherwise."""
        if self.cycle_factor is None:
            return self.round_spec

        trained = layerwise.fedbt_trained(self.global0, r, self.config.num_hidden_layers,
                                          self.cycle_factor)  # fmt: skip
        return dataclasses.replace(self.round_spec, trained=trained)

    @property
    def num_global(self) -> int:
        return _count(self.global0)

    @property
    def num_local(self) -> int:
        return _count(self.local0)

    @property
    def num_frozen(self) -> int:
        return _count(self.frozen)


def _count(tree: Any) -> int:
    return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def round_chunk_size(
    chunk_size: int | None, backend: str, processes: int = 1, secure: bool = False
) -> int | None:
    """Clients trained at once in a round: as configured, else one at a time on a CPU (each
    matmul already fills the cores, and a vmapped round holds every client's state at once) and
    all at once on an accelerator (docs/benchmarks.md); one at a time with several processes or
    secure aggregation (each upload is quantised on its own, `fed.secure_sum`)."""
    check_chunk_size(chunk_size, processes)
    if chunk_size is not None:
        return chunk_size
    return 1 if backend == "cpu" or processes > 1 or secure else None


def check(config: ExperimentConfig) -> int:
    """Cheap checks of a config against the task registry and the model's depth and layers (reads
    only the model's config.json); returns the critical layer as an int in 0..L."""
    validate(config)
    task = tasks.get_task(config.data.task)
    entity_types(config, task)  # a token task's vocabulary, before any file is read
    model_config = hf_checkpoint.load_config(hf_checkpoint.resolve_model(config.model.name))
    if config.model.model_layers is not None:  # a truncated model: its depth is what the rest sees
        model_config = hf_checkpoint.truncate(model_config, {}, config.model.model_layers)[0]
    head = dataclasses.replace(model_config, head=task.objective.head)
    lora.configure(head, config.model.lora_settings())  # e.g. --lora-targets choosing no layer
    cycle_factor(config, model_config.num_hidden_layers)
    fits_positions(config, model_config.max_position_embeddings)
    return validate_critical_layer(config, model_config.num_hidden_layers)


def load_model(config: ExperimentConfig, task: tasks.Task, tag_names: Sequence[str] = ()) -> Any:
    """The pretrained model with the task's head (seeded by the run's seed); a token task's head
    has one output per tag of the pool. The head's outputs carry the task's label names (a token
    task's: its tags), so that an exported model's id2label reads "rotten"/"fresh", not LABEL_0."""
    tag_names = tuple(tag_names)
    return hf_checkpoint.load_pretrained(
        config.model.name,
        num_labels=len(tag_names) if tag_names else task.num_labels,
        seed=config.seed,
        problem_type="regression" if task.is_regression else None,
        dtype=config.runtime.dtype,
        attention=config.runtime.attention,
        head=task.objective.head,
        label_names=tag_names or task.label_names,
        lora=config.model.lora_settings(),
        num_layers=config.model.model_layers,
    )


def cycle_factor(config: ExperimentConfig, num_layers: int) -> int | None:
    """FedBT's cycle factor for an L-layer model (unset: L // 2, at least 1), checked; None
    without the schedule."""
    federation = config.federation
    if federation.layer_schedule != "fedbt":
        return None
    c = max(1, num_layers // 2) if federation.cycle_factor is None else federation.cycle_factor
    if not 1 <= c <= num_layers:
        raise UserError(
            f"--cycle-factor {c} is outside 1..{num_layers} for model {config.model.name!r} "
            f"({num_layers} layers); pass a value in 1..{num_layers}"
        )
    return c


def model_parts(config: ExperimentConfig, pre: Any, critical_layer: int) -> Any:
    """The model's parameters by role (global, local, frozen): the critical layer's split (with
    LoRA, of the adapters and the head, every base weight frozen; with FedBT, of the layers its
    cycle trains and the head, the rest frozen) with --freeze over the Hugging Face tensor
    names."""
    num_layers = pre.config.num_hidden_layers
    split = roles.critical_layer_rule(critical_layer, num_layers)
    if pre.config.lora is not None:
        split = roles.train_only(split, lora.trainable)
    cycle = cycle_factor(config, num_layers)
    if cycle is not None:
        split = roles.train_only(split, layerwise.fedbt_cycled(num_layers, cycle))
    rule = roles.freeze_rule(
        split,
        config.model.freeze,
        hf_checkpoint.tensor_names(pre.config),
    )
    return roles.partition(pre.params, rule)


def make_round_spec(config: ExperimentConfig, apply: Callable[..., Any], task: tasks.Task) -> Any:
    """The round's static description: client update (objective, client optimiser, FedProx mu),
    server optimiser, wire dtype, clients at once, devices."""
    client_cfg, fed, runtime = config.client, config.federation, config.runtime
    client_spec = client.ClientSpec(
        apply=apply,
        objective=task.objective,
        optimizer=client.client_optimizer(
            client_cfg.client_optimizer, client_cfg.lr, schedule=client_cfg.lr_schedule,
            warmup_ratio=client_cfg.warmup_ratio, clip_norm=client_cfg.client_clip_norm,
        ),  # fmt: skip
        prox_mu=config.prox_mu,
    )
    return rounds.RoundSpec(
        client=client_spec,
        server_optimizer=algorithms.server_optimizer(fed.algorithm, fed.effective_server_lr,
                                                     fed.server_tau),
        wire_dtype=WIRE_DTYPE[fed.quantize],
        chunk_size=round_chunk_size(runtime.chunk_size, jax.default_backend(),
                                    jax.process_count(), config.privacy.secure_aggregation),
        devices=devices.for_rounds(runtime.cpu_devices, jax.default_backend()),
        aggregator=safeguards.aggregator(config),
    )


def build_model(config: ExperimentConfig, task: tasks.Task, tag_names: Sequence[str] = ()) -> Model:
    """The model, its roles and its round spec (`tag_names`: a token task's tag vocabulary)."""
    pre = load_model(config, task, tag_names)
    c = validate_critical_layer(config, pre.config.num_hidden_layers)
    global0, local0, frozen = model_parts(config, pre, c)
    model_dir = getattr(pre, "model_dir", None)
    return Model(
        task=task,
        critical_layer=c,
        config=pre.config,
        model_dir=None if model_dir is None else Path(model_dir),
        apply=pre.apply,
        round_spec=make_round_spec(config, pre.apply, task),
        global0=global0,
        local0=local0,
        frozen=frozen,
        cycle_factor=cycle_factor(config, pre.config.num_hidden_layers),
    )


def checkpoint_meta(
    config: ExperimentConfig, model: Model, part: Any, data: str | None = None
) -> dict[str, Any]:
    """What a fine-tuning checkpoint records besides its arrays, simulated or deployed: the seed,
    the partition, the data's fingerprint where the server sees the data (`data`: the
    simulation's) and the model it was made with (checked on --resume), its LoRA adapters."""
    return {
        "seed": config.seed,
        "partition": [{"train": tr, "test": te} for tr, te in partition_lists(part)],
        **({"data": data} if data is not None else {}),
        **model_meta(model),
    }


def model_meta(model: Model) -> dict[str, Any]:
    """What an export needs to know of the model besides its arrays (JSON): its config, where its
    tokenizer lives, the split, its LoRA adapters. A checkpoint records it, and so does a Flower
    node for the export at its site."""
    return {
        "model_config": model.config.to_hf_dict(),
        "model_dir": None if model.model_dir is None else str(model.model_dir),
        "critical_layer": model.critical_layer,
        "lora": lora.fields(model.config),
    }


def method_line(config: ExperimentConfig, model: Model) -> str:
    """The run's method as a person says it (`run.method.describe`), for its first line."""
    fed, c = config.federation, config.client
    return describe(
        fed.algorithm, model.critical_layer, model.config.num_hidden_layers,
        quantize=fed.quantize, num_frozen=model.num_frozen, freeze=config.model.freeze,
        mu=config.prox_mu, lora=model.config if model.config.lora is not None else None,
        cycle=model.cycle_factor,
    ) + client_words(c.client_optimizer, c.lr, c.lr_schedule, c.warmup_ratio,
                     c.client_clip_norm)  # fmt: skip


def start_notes(
    config: ExperimentConfig, model: Model, rounds: int, start_round: int, where: str
) -> list[str]:
    """A fine-tuning run's first lines, the simulation's and the Flower server's alike: its
    method, its safeguards (`safeguards.start_lines`; `rounds`: those DP's budget allows), then
    `where` it runs (the task, its clients) with the parameters a client holds and, with
    --resume, the round it continues after."""
    frozen = f" / {model.num_frozen:,} frozen" if model.num_frozen else ""
    resuming = f"; resuming after round {start_round}" if start_round else ""
    return [
        method_line(config, model),
        *safeguards.start_lines(config, rounds),
        f"{where}, {model.num_global:,} global / {model.num_local:,} local parameters per client"
        + frozen
        + resuming,
    ]


def summary(
    config: ExperimentConfig,
    model: Model,
    history: Sequence[dict[str, Any]],
    publish: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A fine-tuning run at a glance (the simulation's and the Flower server's summary.json):
    final and best primary metric, bytes, time, parameter counts. `publish`: what a record may
    publish (client-level DP's `run.safeguards.public_record`), or None: all of it."""
    metric = model.task.primary_metric
    evaluated = [h for h in history if h.get(metric) is not None and np.isfinite(h[metric])]
    last = history[-1] if history else {}
    final_eval = evaluated[-1] if evaluated else {}
    best = max(evaluated, key=lambda h: h[metric]) if evaluated else {}
    return {
        "task": config.data.task,
        "method": method_line(config, model),
        "label": plots.label_of(config, model),  # the method in a legend's words (tools/plot.py)
        "algorithm": config.federation.algorithm,
        "critical_layer": model.critical_layer,
        "num_layers": model.config.num_hidden_layers,
        "rounds": len(history),
        "primary_metric": metric,
        "final": {k: v for k, v in (final_eval if publish is None else publish(final_eval)).items()
                  if k not in ("clients_sampled",)},  # fmt: skip
        "best_round": best.get("round"),
        "best": best.get(metric),
        **{k: last[k] if history else 0 for k in ("cum_bytes_up", "cum_bytes_down", "cum_bytes")},
        "seconds": float(sum(h["seconds"] for h in history)),
        "train_seconds": float(sum(h["train_seconds"] for h in history)),
        "eval_seconds": float(sum(h["eval_seconds"] for h in history)),
        "global_params": model.num_global,
        "local_params_per_client": model.num_local,
        "frozen_params": model.num_frozen,
        "run_dir": str(config.run_dir),
    }

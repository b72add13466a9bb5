"""From a fine-tuning config to the pieces of a run: the pool, the model and its roles, the
partition, the round's spec, each client's steps, scoring and costs.

Every execution path builds from these: the simulation (`run.experiment`), the Flower server
(`deploy.server`: the model, no data) and each Flower node (`deploy.node`: the model and its own
share), so that all of them derive the same pieces from the same config and seed. Nothing here
writes to the run directory. Randomness comes from the seed only (`default_rng([seed, 0,
purpose])` for the subsample), so a resumed run derives the same pieces again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedjax_split.data import batching, partition, sources, tokenization
from fedjax_split.errors import UserError
from fedjax_split.fed import algorithms, client, layerwise, roles
from fedjax_split.models import hf_checkpoint, lora
from fedjax_split.run import costs, plots, safeguards
from fedjax_split.run.config import ExperimentConfig, validate
from fedjax_split.run.cross_checks import validate_critical_layer
from fedjax_split.run.method import client_words, describe
from fedjax_split.run.runtime_sections import check_chunk_size
from fedjax_split.run.settings import as_given, drop
from fedjax_split.run.sites import site_dirs
from fedjax_split.sim import devices, rounds
from fedjax_split.tasks import bio
from fedjax_split.tasks import registry as tasks

SUBSAMPLE = 0  # purpose of the subsample's numpy seed (rounds.sample_clients uses 1)
WIRE_DTYPE = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Model:
    """The model's pieces as the config makes them: the same on the server, in the simulation and
    on every node. `global0`, `local0`, `frozen`: the pretrained parameters by role (the head
    seeded by the run's seed)."""

    task: Any
    critical_layer: int
    config: Any  # models.bert.BertConfig
    model_dir: Path | None
    apply: Callable[..., Any]
    round_spec: Any  # sim.rounds.RoundSpec
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


@dataclasses.dataclass(frozen=True)
class Pool:
    """A labelled task's pool as every client of a run sees it: the examples (their labels, MNLI's
    groups, a token task's tag names), tokenised and packed once, and the packed batches'
    attention-row width (run-wide, from the pool's longest example). A client's steps are cut
    from its own rows of it."""

    examples: Any
    labels: np.ndarray
    tokenized: Any
    row_width: int | None


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


def subsample_indices(n: int, max_examples: int | None, seed: int) -> np.ndarray | None:
    """Indices of a uniform subsample (sorted, so the pool keeps its order), or None for all."""
    if max_examples is None or max_examples >= n:
        return None
    rng = np.random.default_rng([seed, 0, SUBSAMPLE])
    return np.sort(rng.choice(n, size=max_examples, replace=False))


_ROW_FIELDS = ("texts_a", "texts_b", "tokens", "tags", "labels", "groups", "splits")


def subset_examples(examples: Any, idx: np.ndarray | None) -> Any:
    """The pool's rows `idx` (all of it for None), every per-row field taken alike."""
    if idx is None:
        return examples

    def take(seq: Any) -> Any:
        if seq is None:
            return None
        if isinstance(seq, np.ndarray):
            return seq[idx]
        return [seq[i] for i in idx]

    changes = {f: take(getattr(examples, f)) for f in _ROW_FIELDS if hasattr(examples, f)}
    if dataclasses.is_dataclass(examples):
        return dataclasses.replace(examples, **changes)
    return examples._replace(**changes)


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
    return validate_critical_layer(config, model_config.num_hidden_layers)


def entity_types(config: ExperimentConfig, task: Any) -> tuple[str, ...] | None:
    """A token task's entity types, its tag vocabulary "O" and B-/I- of each: the task's own
    (the offline corpora), else --entity-types, else None: a pool's own tags decide. Sites
    (--site-data) never decide it, so that every site's head and the server's agree without
    any of them seeing another site's tags; None for other tasks."""
    given = config.data.entity_type_list()
    if not task.objective.per_token:
        if given is not None:
            raise UserError(f"{as_given(config, 'entity_types')} with task {task.name}: only a "
                            "token task (ner, wnut16, nero) has entity types; "
                            f"{drop(config, 'entity_types')}")  # fmt: skip
        return None
    if task.entity_types:
        if given is not None and given != task.entity_types:
            raise UserError(
                f"{as_given(config, 'entity_types')} but task {task.name} has its own types "
                f"{','.join(task.entity_types)}; {drop(config, 'entity_types')}"
            )
        return task.entity_types
    if given is None and config.data.site_data is not None:
        raise UserError(
            f"task {task.name} with --site-data needs its tag vocabulary from the run, not from "
            "the sites' tags: pass --entity-types TYPE1,TYPE2,... (e.g. PER,LOC,ORG)"
        )
    return given


def tag_names(config: ExperimentConfig, task: Any) -> tuple[str, ...]:
    """The run's tag vocabulary as the config gives it (`entity_types`); () where the pool's
    own tags decide it, or for a task without tags."""
    types = entity_types(config, task)
    return () if types is None else tuple(bio.tag_vocabulary(types))


def load_pool(config: ExperimentConfig, task: Any) -> Any:
    """The task's example pool as every client sees it: loaded, then subsampled (--max-examples).
    A token task's tag vocabulary (`tag_names`) is the run's (`entity_types`), else the whole
    pool's, taken before subsampling."""
    examples = sources.load_examples(task, data_dir=config.data.data_dir,
                                     entity_types=entity_types(config, task))  # fmt: skip
    idx = subsample_indices(len(examples.labels), config.data.max_examples, config.seed)
    return subset_examples(examples, idx)


def concat_examples(parts: Sequence[Any]) -> Any:
    """The sites' examples one after another, in client order (every per-row field alike; the
    other fields, such as a token task's tag names, are the first part's)."""
    def join(seqs: list[Any]) -> Any:
        if all(x is None for x in seqs):
            return None
        if any(isinstance(x, np.ndarray) for x in seqs):
            return np.concatenate([np.asarray(x) for x in seqs])
        return [row for x in seqs for row in x]

    first = parts[0]
    changes = {f: join([getattr(p, f) for p in parts]) for f in _ROW_FIELDS if hasattr(first, f)}
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **changes)
    return first._replace(**changes)


def load_site(config: ExperimentConfig, task: Any, client_id: int, site_dir: Any) -> Any:
    """Client `client_id`'s examples: its site's own files alone (`sources.load_site`), in the
    task's label vocabulary; a bad file is one line naming the site and the file."""
    try:
        return sources.load_site(task, site_dir, entity_types=entity_types(config, task))
    except UserError as err:
        raise UserError(f"site {client_id} ({site_dir}): {err}") from None


def site_split(config: ExperimentConfig, examples: Any, client_id: int, site_dir: Any) -> Any:
    """A site's own train/test split (`partition.site_split`, indices into its own rows); a site
    without training examples is a UserError."""
    split = partition.site_split(getattr(examples, "splits", None), len(examples), config.seed,
                                 client_id)  # fmt: skip
    if split.train.size == 0:
        raise UserError(
            f"site {client_id} ({site_dir}) has no training examples; give it a train file "
            "with at least one example"
        )
    return split


def load_sites(config: ExperimentConfig, task: Any) -> tuple[Any, Any]:
    """--site-data in one process (the simulation): (every site's examples in client order,
    the `partition.sites_partition` whose client k holds exactly site k's rows)."""
    dirs = site_dirs(config)
    if not dirs:
        raise UserError(
            f"--site-data {config.data.site_data}: the simulation reads every site itself; pass "
            "the sites' directories DIR0,DIR1,..."
        )
    sites = [load_site(config, task, k, d) for k, d in enumerate(dirs)]
    splits = [site_split(config, sites[k], k, d) for k, d in enumerate(dirs)]
    part = partition.sites_partition(splits, [len(ex) for ex in sites], config.seed, task.name)
    return concat_examples(sites), part


def load_model(config: ExperimentConfig, task: Any, tag_names: Sequence[str] = ()) -> Any:
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
    fed = config.federation
    if fed.layer_schedule != "fedbt":
        return None
    c = max(1, num_layers // 2) if fed.cycle_factor is None else fed.cycle_factor
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


def make_round_spec(config: ExperimentConfig, apply: Callable[..., Any], task: Any) -> Any:
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


def build_model(config: ExperimentConfig, task: Any, tag_names: Sequence[str] = ()) -> Model:
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


def make_partition(config: ExperimentConfig, task: Any, labels: np.ndarray) -> Any:
    """The clients' train/test split of the pool; a client without training examples is a
    UserError."""
    data, fed = config.data, config.federation
    part = partition.partition_clients(
        labels,
        scheme=data.partition,
        num_clients=fed.clients,
        seed=config.seed,
        alpha=data.alpha if data.partition == "dirichlet" else None,
        beta=data.beta if data.partition == "quantity" else None,
        # a token task partitions by each sentence's dominant entity type, not by its tags
        task=None if task.objective.per_token else task,
        fill=data.paper_fill,
    )
    for i, cs in enumerate(part.clients):
        if len(cs.train) == 0:
            raise UserError(
                f"client {i} got no training examples ({len(labels)} examples for "
                f"{fed.clients} clients); use more data (--max-examples) or fewer --clients"
            )
    return part


def partition_lists(part: Any) -> list[list[list[int]]]:
    """Each client's [train, test] pool indices as plain lists (a checkpoint's record of them)."""
    return [[np.asarray(c.train).tolist(), np.asarray(c.test).tolist()] for c in part.clients]


def checkpoint_meta(config: ExperimentConfig, model: Model, part: Any) -> dict[str, Any]:
    """What a fine-tuning checkpoint records besides its arrays, simulated or deployed: the seed,
    the partition and the model it was made with (checked on --resume), its LoRA adapters."""
    return {
        "seed": config.seed,
        "partition": [{"train": tr, "test": te} for tr, te in partition_lists(part)],
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


def check_partition(meta: dict[str, Any], part: Any, what: str) -> None:
    """UserError unless the checkpoint's partition (`meta`) is `part`; `what`: where the data
    come from, for the message."""
    saved = [[list(c["train"]), list(c["test"])] for c in meta["partition"]]
    if saved != partition_lists(part):
        raise UserError(
            f"--resume: {what} or partition differ from the checkpoint's; use the same data "
            "and --max-examples/--seed, or another --output-dir"
        )


def load_tokenized(config: ExperimentConfig, task: Any, examples: Any, model_dir: Any) -> Any:
    """The pool tokenised with the model's tokenizer and flattened once (`batching.pack`)."""
    tokenizer = tokenization.load_tokenizer(config.model.name if model_dir is None else model_dir)
    rows = sources.tokenize_examples(examples, tokenizer, task, config.data.max_length)
    return batching.pack(rows)


def row_width(config: ExperimentConfig, tokenized: Any) -> int:
    """W of packed attention rows, T of padded batches: run-wide, from the pool's longest
    example. Sites with their own data see no pool: theirs come from --max-length, the longest
    any example can be, so that every site cuts the same shapes without the others' data."""
    floor = batching.PACK_WIDTH if config.runtime.packing else 8
    if config.data.site_data is not None:
        return batching.row_width_for(config.data.max_length, floor)
    return batching.default_row_width(tokenized, floor)


def eval_batch_size(config: ExperimentConfig) -> int:
    """Evaluation batches: at least 32 examples (no gradients to hold)."""
    return max(config.client.batch_size, 32)


def batching_of(
    config: ExperimentConfig, task: Any, width: int | None, *, evaluation: bool = False
) -> Any:
    """The run's `batching.Batching` (every client's, every round's), from the config alone;
    `evaluation`: with the evaluation batch size (`eval_batch_size`). A packed part's tokens come
    from the pool (`batching.default_part_tokens`), or, for sites with their own data, from the
    config alone (`batching.part_tokens_for`), the same at every site."""
    size = eval_batch_size(config) if evaluation else config.client.batch_size
    part_tokens = None
    if config.runtime.packing and config.data.site_data is not None and width is not None:
        part_tokens = batching.part_tokens_for(size, width)
    return batching.Batching(
        batch_size=size,
        objective=task.objective,
        packing=config.runtime.packing,
        bucketing=config.runtime.bucketing,
        row_width=width,
        part_tokens=part_tokens,
    )


def make_pool(config: ExperimentConfig, examples: Any, tokenized: Any) -> Pool:
    """The pool with its labels as an array and the run's row width."""
    return Pool(examples, np.asarray(examples.labels), tokenized, row_width(config, tokenized))


def client_steps(
    config: ExperimentConfig, task: Any, pool: Pool, indices: np.ndarray, client_id: int, r: int
) -> list[Any]:
    """Round r's training steps of one client: a pure function of the config, r, the client's
    id and its own examples (`indices` into the pool: what a federated client builds alone)."""
    return batching.client_batches(
        pool.tokenized,
        indices,
        pool.labels,
        batching_of(config, task, pool.row_width),
        epochs=config.client.local_epochs,
        seed=[config.seed, r],
        client_id=int(client_id),
    )


def client_eval_steps(
    config: ExperimentConfig, task: Any, pool: Pool, indices: np.ndarray
) -> list[Any]:
    """One client's test batches (its own examples, once each, in order, the run's one
    evaluation shape)."""
    how = batching_of(config, task, pool.row_width, evaluation=True)
    return batching.client_eval_batches(pool.tokenized, indices, pool.labels, how)


def positions(parts: Sequence[Any]) -> np.ndarray:
    """[real tokens, computed positions] of a round's training parts (the rest is the fixed
    shapes' padding: `data.batching`); masked parts, which a client running alone skips, are not
    counted."""
    return np.asarray(batching.positions(parts, skip_masked_steps=True), np.int64)


def score(task: Any, examples: Any, res: Any) -> dict[str, float]:
    """The task's metrics of one set of predictions (MNLI's groups by each row's pool index, a
    token task's entities by the pool's tag names)."""
    groups = getattr(examples, "groups", None)
    return tasks.compute_metrics(
        task,
        res.predictions,
        res.labels,
        groups=None if groups is None else np.asarray(groups)[res.example_index],
        label_names=getattr(examples, "tag_names", None),
    )


def mean_over_clients(per_client: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Unweighted mean of each metric over clients (the paper's figure).

    A metric undefined for a client (NaN: e.g. Pearson on a constant test split) is left out of
    the mean rather than turning it into NaN; the per-client entry keeps it (null in JSON).
    """
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    mean = {}
    for m in names:
        vals = [pc[m] for pc in per_client if pc.get(m) is not None and np.isfinite(pc[m])]
        mean[m] = float(np.mean(vals)) if vals else float("nan")
    return mean


LOW_PERCENTILE = 10  # `p10_client`: numpy's percentile, its default linear interpolation


def _defined(value: Any) -> bool:
    return value is not None and bool(np.isfinite(value))


def _finite(per_client: Sequence[dict[str, Any]], metric: str) -> list[float]:
    return [float(pc[metric]) for pc in per_client if _defined(pc.get(metric))]


def spread_over_clients(per_client: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The clients the mean hides: `worst_client`, each metric's lowest figure over clients (every
    task's metrics are higher-is-better), and `p10_client`, its 10th percentile (numpy's default,
    linear interpolation between the sorted figures: with n clients, position 0.1 (n - 1)).
    Undefined figures (NaN) are left out as in `mean_over_clients`; NaN where none is left."""
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    worst, low = {}, {}
    for m in names:
        vals = _finite(per_client, m)
        worst[m] = min(vals) if vals else float("nan")
        low[m] = float(np.percentile(vals, LOW_PERCENTILE)) if vals else float("nan")
    return {"worst_client": worst, "p10_client": low}


def personalization_gain(
    per_client: Sequence[dict[str, Any]], global_clients: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """Each metric's mean over clients of (the client's personal model's figure minus the global
    model's, both on the client's own test split); a client enters a metric's mean where both of
    its figures are defined."""
    theirs = {int(g["client"]): g for g in global_clients}
    names = sorted(set().union(*per_client) - {"client"}) if per_client else []
    gain = {}
    for m in names:
        pairs = [(pc.get(m), theirs.get(pc["client"], {}).get(m)) for pc in per_client]
        diffs = [own - glob for own, glob in pairs if _defined(own) and _defined(glob)]
        gain[m] = float(np.mean(diffs)) if diffs else float("nan")
    return gain


def personalised_record(
    per_client: Sequence[dict[str, Any]],
    trained: set[int] | None,
    global_clients: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An evaluation's record: each metric's mean over all clients (the paper's figure), each
    client's, the worst client's and the 10th percentile (`spread_over_clients`), and
    `trained_mean` over the clients in `trained` (those trained at least once: with partial
    participation the mean over all includes clients that never trained). `global_clients`: the
    global model's figures on each client's test split (a split run's last evaluation), kept
    with `personalization_gain`. Clients without test examples have no figures at all."""
    record: dict[str, Any] = {**mean_over_clients(per_client), "clients": list(per_client)}
    if per_client:
        record.update(spread_over_clients(per_client))
    if trained is not None:
        record["trained_mean"] = mean_over_clients(
            [pc for pc in per_client if pc["client"] in trained]
        )
    if global_clients is not None:
        record["global_clients"] = list(global_clients)
        record["personalization_gain"] = personalization_gain(per_client, global_clients)
    return record


def round_costs(
    history: Sequence[dict[str, Any]],
    bytes_up: int,
    bytes_down: int,
    t0: float,
    t_train: float,
    t_eval: float,
) -> dict[str, Any]:
    """A round record's bytes (this round's and, with `history`, cumulative) and seconds; the
    simulation and the Flower server write the same fields."""
    previous = history[-1] if history else None
    cum_up = bytes_up + (previous["cum_bytes_up"] if previous else 0)
    cum_down = bytes_down + (previous["cum_bytes_down"] if previous else 0)
    return dict(
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        cum_bytes_up=cum_up,
        cum_bytes_down=cum_down,
        cum_bytes=cum_up + cum_down,
        seconds=t_eval - t0,
        # where the round's time went: sampling, batching, training and the server step (with
        # the first round's compilation), then evaluation (0 when not due)
        train_seconds=t_train - t0,
        eval_seconds=t_eval - t_train,
    )


def cost_record(
    history: Sequence[dict[str, Any]], bytes_up: int, bytes_down: int,
    times: tuple[float, float, float], clients: Sequence[Any], exact: bool,
    bert_fl_bytes: int | None, sampled: int,
) -> dict[str, Any]:  # fmt: skip
    """A round record's bytes and seconds (`round_costs`; `times`: the round's start, the end of
    its training and of its evaluation), then its FLOPs (`run.costs.round_record` of the
    sampled clients' `clients` counts): the simulation's and the Flower server's."""
    record = round_costs(history, bytes_up, bytes_down, *times)
    record.update(costs.round_record(history, clients, exact, bert_fl_bytes, sampled))
    return record


def newest_rounds(history: Sequence[dict[str, Any]]) -> dict[int, int]:
    """Each client's last round among the records' sampled clients: the round of its newest
    part in a simulation's client store (every sampled client stores its part)."""
    return {int(c): int(h["round"]) for h in history for c in h["clients_sampled"]}


def trained_clients(history: Sequence[dict[str, Any]], now: Sequence[int] = ()) -> set[int]:
    """The clients whose updates the server has taken so far: every round's sampled clients but
    those that failed (a deployed round's `clients_failed`), and `now`."""
    done = {
        int(c)
        for h in history
        for c in h["clients_sampled"]
        if c not in h.get("clients_failed", ())
    }
    return done | {int(c) for c in now}


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

"""The data side of a fine-tuning run, from the config: the pool (subsampled, tokenised once), a
site's own files, the partition over clients, and each client's training and test batches.

Every transport draws from these (the simulation, each Flower node for its own share; the Flower
server draws nothing), so all derive the same data from the same config and seed: randomness is
`default_rng([seed, 0, SUBSAMPLE])` for the subsample, and the batches are pure functions of the
config, the round and the client. Nothing here writes to the run directory.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedjax_split.data import batching, partition, sources, tokenization
from fedjax_split.errors import UserError
from fedjax_split.run.config import ExperimentConfig
from fedjax_split.run.settings import as_given, drop
from fedjax_split.run.sites import site_dirs
from fedjax_split.tasks import bio
from fedjax_split.tasks import registry as tasks

SUBSAMPLE = 0  # purpose of the subsample's numpy seed (rounds.sample_clients uses 1)


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


def entity_types(config: ExperimentConfig, task: tasks.Task) -> tuple[str, ...] | None:
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


def tag_names(config: ExperimentConfig, task: tasks.Task) -> tuple[str, ...]:
    """The run's tag vocabulary as the config gives it (`entity_types`); () where the pool's
    own tags decide it, or for a task without tags."""
    types = entity_types(config, task)
    return () if types is None else tuple(bio.tag_vocabulary(types))


def load_pool(config: ExperimentConfig, task: tasks.Task) -> Any:
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


def load_site(config: ExperimentConfig, task: tasks.Task, client_id: int, site_dir: Any) -> Any:
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
    if split.test.size == 0:  # too few rows for a fifth to test, and no dev/test file
        warnings.warn(
            f"site {client_id} ({site_dir}) has no test examples ({split.train.size} training "
            "rows and no dev file): it trains but is not scored, nor in the mean over clients; "
            "give it a dev file",
            stacklevel=2,
        )
    return split


def load_sites(config: ExperimentConfig, task: tasks.Task) -> tuple[Any, Any]:
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


def make_partition(config: ExperimentConfig, task: tasks.Task, labels: np.ndarray) -> Any:
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


def check_partition(
    meta: dict[str, Any], part: Any, what: str, data: str | None = None
) -> None:
    """UserError unless the checkpoint's partition (`meta`) is `part` and, where both know it,
    its data's fingerprint is `data` (the same indices over edited texts or labels, a site's
    files changed since, would otherwise train on); `what`: where the data come from."""
    saved = [[list(c["train"]), list(c["test"])] for c in meta["partition"]]
    if saved != partition_lists(part):
        raise UserError(
            f"--resume: {what} or partition differ from the checkpoint's; use the same data "
            "and --max-examples/--seed, or another --output-dir"
        )
    if data is not None and meta.get("data", data) != data:  # runs saved before: not recorded
        raise UserError(
            f"--resume: {what} have the checkpoint's examples but other texts or labels (files "
            "edited since, or another version of the dataset?); restore them, or start a fresh "
            "run in another --output-dir"
        )


def load_tokenized(
    config: ExperimentConfig, task: tasks.Task, examples: Any, model_dir: Any
) -> Any:
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
    config: ExperimentConfig, task: tasks.Task, width: int | None, *, evaluation: bool = False
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
    config: ExperimentConfig, task: tasks.Task, pool: Pool, indices: np.ndarray, client_id: int,
    r: int,
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
    config: ExperimentConfig, task: tasks.Task, pool: Pool, indices: np.ndarray
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

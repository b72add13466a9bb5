"""The run's data section: the task, where its examples come from, how the pool is split into
clients; each setting's own checks beside it (`DataSettings.check`).

Its choices are copies of the data modules' (`data.partition`), kept here so that parsing the
flags imports no JAX; tests/test_config.py holds them equal.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.errors import UserError
from fedjax_split.run.settings import TASK, Section
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.sites import refuse_with_sites
from fedjax_split.run.value_checks import at_least_one, check_data_dir, positive_number
from fedjax_split.tasks.registry import TASKS, get_task

PARTITIONS = ("paper", "dirichlet", "quantity", "iid")
PAPER_FILLS = ("exact", "sequential")  # data.partition.FILLS

_TASK_KINDS = {"glue": "a GLUE task", "offline": "an offline corpus", "ner": "a NER task"}
# settings that draw a partition from a pool: with --site-data there is none to draw
_POOL_ONLY = ("partition", "paper_fill", "alpha", "beta", "max_examples", "data_dir")


def _task_help() -> str:
    """--task's help, listing every registered task by kind (the registry loads no JAX: a task's
    objective is imported on first use)."""
    kinds: dict[str, list[str]] = {}
    for task in TASKS.values():
        kinds.setdefault(task.kind, []).append(task.name)
    parts = [f"{_TASK_KINDS.get(k, k)} ({', '.join(names)})" for k, names in kinds.items()]
    listed = f"{', '.join(parts[:-1])} or {parts[-1]}" if len(parts) > 1 else parts[0]
    return f"Task: {listed}."


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

    def check(self, config: Any) -> None:
        """Counts of at least 1, the Dirichlet concentrations, --data-dir, --entity-types, and
        with --site-data none of the settings that subsample or partition a pool (they would be
        silently ignored); that the sites are the clients: `run.cross_checks`."""
        at_least_one(config, "max_length", "max_examples")
        get_task(self.task)  # an unknown task: one line naming the known ones
        positive_number(config, "alpha", "beta")
        check_data_dir(config)
        if self.site_data is not None:
            refuse_with_sites(config, _POOL_ONLY, "data are its own site's files, not drawn from "
                              "a pool", "partition one pool")  # fmt: skip
        self.entity_type_list()

    def entity_type_list(self) -> tuple[str, ...] | None:
        """--entity-types as sorted types (None when unset); a UserError for an empty entry, a
        duplicate, a space (CoNLL columns are split on spaces) or a tag given for a type."""
        if self.entity_types is None:
            return None
        types = [t.strip() for t in self.entity_types.split(",")]
        for t in types:
            if not t or any(c.isspace() for c in t) or t == "O" or t[:2] in ("B-", "I-"):
                raise UserError(
                    f"--entity-types {self.entity_types!r}: {t!r} is not an entity type; pass "
                    "TYPE1,TYPE2,... (e.g. PER,LOC,ORG: the tags are O and B-/I- of each)"
                )
        twice = sorted({t for t in types if types.count(t) > 1})
        if twice:
            raise UserError(f"--entity-types names {twice[0]!r} twice; name each type once")
        return tuple(sorted(types))

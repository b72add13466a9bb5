"""run_experiment(config): federated fine-tuning simulated in one process.

The pieces come from `run.pieces` (the same the Flower server and nodes build), the loop from
`run.driver`; this module holds what only the simulation has: every client's data and local part
in one process (the local parts in a client store on disk, `clients/` in the run directory), its
round (`sim.rounds.run_round` over the sampled clients, the next round's batches built while the
current one runs) and its evaluation of every client's personalised model. Importable (notebooks
call `run_experiment`); `python -m fedjax_split.train` is a thin wrapper.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_split import runtime
from fedjax_split.data import partition as partition_mod
from fedjax_split.data import sources
from fedjax_split.errors import UserError
from fedjax_split.fed import aggregation, roles, wire
from fedjax_split.fed.secret import CHECKPOINT_KEY, ServerSecret
from fedjax_split.fed.strategy import RoundPlan
from fedjax_split.models.bert_config import check_attention
from fedjax_split.run import (
    client_data,
    client_scores,
    driver,
    pieces,
    plots,
    round_records,
    safeguards,
    saved_config,
)
from fedjax_split.run import costs as costs_mod
from fedjax_split.run.config import ExperimentConfig, resolve_config
from fedjax_split.sim import evaluation, processes, rounds
from fedjax_split.sim.client_store import ClientStore
from fedjax_split.tasks import registry as tasks

CLIENTS_DIR = "clients"  # the run's client store (sim/client_store.py)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a simulated run needs in memory, built from the config before anything is written:
    the model, the pool (every client's examples) and its partition. It does not change while
    the run runs; the run's state is `Simulation`'s."""

    config: ExperimentConfig
    model: pieces.Model
    pool: client_data.Pool
    partition: Any
    eval_batches: list[list[Any]]  # each client's test batches


def build(config: ExperimentConfig) -> Setup:
    """Load task, data, model; partition, tokenise. Writes nothing."""
    task = tasks.get_task(config.data.task)
    # the data first: a token task's tag vocabulary (from the whole pool) sizes the model's head;
    # sites with their own data are their clients' data as they are (no pool to partition)
    if config.data.site_data is not None:
        examples, part = client_data.load_sites(config, task)
    else:
        examples, part = client_data.load_pool(config, task), None
    model = pieces.build_model(config, task, getattr(examples, "tag_names", ()))
    pool = client_data.make_pool(
        config, examples, client_data.load_tokenized(config, task, examples, model.model_dir)
    )
    if part is None:
        part = client_data.make_partition(config, task, pool.labels)
    eval_batches = [client_data.client_eval_steps(config, task, pool, cs.test)
                    for cs in part.clients]  # fmt: skip
    return Setup(config, model, pool, part, eval_batches)


def round_batches(
    setup: Setup, r: int, secret: ServerSecret | None = None
) -> list[list[Any] | None]:
    """Round r's training steps of each sampled client (a pure function of the config, r and the
    client's own examples); None for the clients another process trains (`sim.processes`).
    `secret`: the server's, for DP's Poisson sample."""
    config = setup.config
    sampled = safeguards.sample(config, r, secret)
    mine = own_positions(setup, len(sampled))
    return [
        client_data.client_steps(config, setup.model.task, setup.pool,
                            setup.partition.clients[i].train, int(i), r) if k in mine else None
        for k, i in enumerate(sampled)
    ]  # fmt: skip


def round_costs(
    setup: Setup, paths: Any, spec: Any, segments: list[list[Any] | None], sampled: Any
) -> list[dict[str, int]]:
    """Each sampled client's `run.costs.client_costs`, in client order (every process counts its
    own clients' steps and the counts are gathered); `paths`: the model's `run.costs.ModelPaths`."""
    schedule = setup.model.cycle_factor is not None
    own = {str(int(c)): costs_mod.client_costs(paths, spec.trained, seg, schedule)
           for c, seg in zip(sampled, segments, strict=True) if seg is not None}  # fmt: skip
    if processes.count() > 1:
        for part in processes.gather_json(own):
            own.update(part)
    return [own[str(int(c))] for c in sampled]


def own_positions(setup: Setup, num_sampled: int) -> set[int]:
    """The positions among a round's sampled clients that this process trains (all of them in a
    one-process run)."""
    owner = processes.owners(rounds.round_devices(setup.model.round_spec), num_sampled)
    return {k for k, p in enumerate(owner) if p == processes.index()}


def evaluate(
    setup: Setup, server_state: Any, frozen: Any, store: Any, trained: set[int] | None = None,
    *, last: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Personalised evaluation: each client's merged model on its own test split, a group of
    clients at a time (`evaluation.evaluate_personalised`; `client_scores.personalised_record`'s
    figures); when nothing is local, also `pooled`: the one global model on the union of the
    clients' test data (FedNLP's figure; with a local part there is no single global model).
    `last` (the run's last evaluation), with a local part: also the global model on each client's
    test split (`global_figures`) and the personalisation gain.
    With several processes, process p scores the clients whose id is p mod P and the figures are
    gathered in client order (`sim.processes`)."""
    model = setup.model
    # the server holds the global part in the wire dtype; clients cast what they receive to fp32
    global_params = roles.merge_params(
        wire.cast_from_wire(server_state.global_params, jnp.float32), frozen
    )
    ids = range(processes.index(), len(setup.eval_batches), processes.count())
    mine = evaluation.evaluate_personalised(
        model.apply, global_params, store.load, setup.eval_batches, ids, model.task.objective
    )
    # a client without test examples has no metric
    results = [(i, res) for i, res in zip(ids, mine, strict=True) if len(res.labels)]
    per_client = _scored(setup, results)
    pooled = model.num_local == 0  # every client's model is the global model
    if processes.count() > 1:
        results = _gather_predictions(results) if pooled else []
    theirs = global_figures(setup, global_params, ids) if last and not pooled else None
    record = client_scores.personalised_record(per_client, trained, theirs)
    if pooled and results:
        pooled_rows = evaluation.ClientPredictions(
            *(evaluation.concat_rows([getattr(r, f) for _, r in results])
              for f in ("predictions", "labels", "example_index"))
        )  # fmt: skip
        record["pooled"] = client_scores.score(model.task, setup.pool.examples, pooled_rows)
    return record


def global_figures(setup: Setup, global_params: Any, ids: Sequence[int]) -> list[dict[str, Any]]:
    """A split run's global model on each client's own test split: the shared part with the
    initial local part (the pretrained upper layers and the run's seeded head), the model a
    client that never trained holds; a split run has no trained global head (docs/usage.md,
    "Per-client figures"). One model for every client, so it is scored as one (cheap)."""
    model, batches = setup.model, setup.eval_batches
    initial = model.local0
    theirs = evaluation.evaluate_personalised(
        model.apply, global_params, lambda i: initial, batches, ids, model.task.objective
    )
    return _scored(setup, [(i, res) for i, res in zip(ids, theirs, strict=True)
                           if len(res.labels)])  # fmt: skip


def _scored(setup: Setup, results: Sequence[tuple[int, Any]]) -> list[dict[str, Any]]:
    """Each client's metrics of its predictions, gathered from every process in client order."""
    per_client = [{"client": i, **client_scores.score(setup.model.task, setup.pool.examples, res)}
                  for i, res in results]  # fmt: skip
    if processes.count() > 1:
        per_client = sorted((r for part in processes.gather_json(per_client) for r in part),
                            key=lambda r: r["client"])  # fmt: skip
    return per_client


def _gather_predictions(results: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Every process's (client id, predictions), in client order."""
    fields = evaluation.ClientPredictions._fields
    arrays = {f"{i}/{f}": getattr(r, f) for i, r in results for f in fields
              if getattr(r, f) is not None}  # fmt: skip
    merged: dict[str, Any] = {}
    for part in processes.gather_arrays(arrays):
        merged.update(part)
    ids = sorted({int(name.split("/")[0]) for name in merged})
    return [(i, evaluation.ClientPredictions(*(merged.get(f"{i}/{f}") for f in fields)))
            for i in ids]  # fmt: skip


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


class Simulation:
    """The simulation's `driver.Run`: the server state, the client store, the prefetched batches."""

    per_run = ("frozen",)  # never changes: stored once per run, not in every checkpoint

    def __init__(self, setup: Setup, store: Any = None) -> None:
        self.setup = setup
        config, model = setup.config, setup.model
        self.data = setup.pool.examples.fingerprint()  # each checkpoint's, checked on --resume
        self.run_dir = config.run_dir
        self.rounds = safeguards.rounds_allowed(config)  # --rounds, or fewer: DP's budget
        self.metric = model.task.primary_metric
        spec = model.round_spec
        self.server_state = rounds.init_server_state(
            model.global0, spec.server_optimizer, spec.wire_dtype,
            aggregation.init_state(spec.aggregator),
        )  # fmt: skip
        self.frozen = model.frozen  # one copy for every client, never trained or sent
        self.store = store  # sim.client_store.ClientStore: each client's local part
        self.prefetched: tuple[int, list[Any]] | None = None  # (round, its clients' steps)
        self.positions = np.zeros(2, np.int64)  # real tokens, positions computed (training)
        self.newest: dict[int, int] = {}  # client -> the round of its newest stored part
        # what the label priors alone score: the plot's dashed line and the summary's figure
        self.majority = plots.majority_score(
            model.task, setup.pool.labels, setup.partition.clients, self.metric
        )
        self.progress: Any = None  # run.outputs.Progress, from the driver (`watch`)
        self.writes = processes.writes()  # process 0 of a multi-process run, or the one process
        # a client's local part's shapes: what a process dealt no client of a round gathers
        self.local_like = jax.eval_shape(lambda: model.local0)
        # the model's paths by role (its FLOP counts), and with a layer schedule, what BERT-FL
        # sends each way per client and round (run.costs)
        self.paths = costs_mod.paths_of(model)
        self.bert_fl_bytes = (None if model.cycle_factor is None
                              else costs_mod.model_bytes(model, spec.wire_dtype))  # fmt: skip
        # DP's secret noise and sample (fed.secret): one secret for the run, process 0's
        self.secret = shared_secret(safeguards.server_secret(config))
        self.publish = safeguards.publisher(config)  # DP: the per-client figures kept private
        # the run's algorithm: sampling, the round's plan, the server's step, the record
        self.strategy = safeguards.strategy(config, model.round_spec_for)

    def plot(self, records: Sequence[dict[str, Any]]) -> Path | None:
        """plot.png from the records so far (None before the first evaluation)."""
        if not self.writes:
            return self.run_dir / "plot.png" if (self.run_dir / "plot.png").exists() else None
        return plots.write_fine_tuning_plot(
            self.run_dir, records, self.setup.config, self.setup.model, self.majority, self.publish
        )

    def watch(self, progress: Any) -> None:
        self.progress = progress

    def arrays(self) -> dict[str, Any]:
        """The server's state and the frozen part (when there is one, stored once per run:
        `per_run`), so that an export needs nothing but the run directory; the clients' local
        parts are versioned in the store."""
        state: dict[str, Any] = {"server_state": self.server_state}
        if self.secret is not None:  # the checkpoint is the server's: --resume draws alike
            state[CHECKPOINT_KEY] = self.secret.to_array()
        return {**state, "frozen": self.frozen} if self.frozen else state

    def meta(self) -> dict[str, Any]:
        setup = self.setup
        return pieces.checkpoint_meta(setup.config, setup.model, setup.partition, self.data)

    def resume(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        if meta.get("deploy") is not None:
            raise UserError(
                f"--resume: this run was written by the {meta['deploy']} server (its clients' "
                "local parts are on its nodes); continue it with `python -m fedjax_split.flower`"
            )
        client_data.check_partition(meta, self.setup.partition, "the data", self.data)
        if not (self.run_dir / CLIENTS_DIR / "initial.npz").is_file():
            raise UserError(
                f"{str(self.run_dir)!r} has no client store ({CLIENTS_DIR}/) to resume from; "
                "start a new run in another --output-dir"
            )
        self.server_state = arrays["server_state"]
        if self.secret is not None:
            self.secret = ServerSecret.from_array(arrays[CHECKPOINT_KEY])
        self.frozen = arrays.get("frozen", self.frozen)
        # each client's part in the store
        self.newest = round_records.newest_rounds(meta["history"])

    def start(self, start_round: int, note: Callable[[str], None]) -> None:
        setup, config, model = self.setup, self.setup.config, self.setup.model
        labels = setup.pool.labels
        names = sources.label_names_or_none(model.task, setup.pool.examples)
        if self.writes:  # process 0 sets up the one client store every process writes into
            if start_round:  # versions written after the checkpoint are redone
                ClientStore(self.run_dir / CLIENTS_DIR).rewind(start_round)
            else:  # a fresh run (or one that finished no round): no checkpoint needs what is there
                ClientStore.create(self.run_dir / CLIENTS_DIR, model.local0)
            partition_mod.save_partition(setup.partition,
                                         safeguards.partition_path(config, self.run_dir),
                                         labels, label_names=names)  # fmt: skip
        processes.barrier("client store ready")
        # each client's newest part is known from the rounds' sampled clients, so a process
        # opens it by name (a shared filesystem may list another host's new files late)
        self.store = ClientStore(self.run_dir / CLIENTS_DIR, newest=self.newest)
        where = f"{config.data.task}: {len(labels)} examples, {config.federation.clients} clients"
        for line in pieces.start_notes(config, model, self.rounds, start_round, where):
            note(line)
        if not start_round:
            note(partition_mod.partition_report(setup.partition, labels, names))

    def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The strategy's plan (clients, spec, clip, noise key), the sampled clients' batches,
        the round (`sim.rounds.run_round`: training and the server's step), the strategy's
        record, an evaluation when due. With progress the round reports inside
        (`outputs.Progress.training`): the next round's batches are then built while its last
        programs run, not the whole round."""
        setup = self.setup
        t0 = time.perf_counter()
        plan = self.strategy.plan(r, self.server_state, self.secret)  # before the round donates
        sampled, spec = plan.clients, plan.spec
        ready = self.prefetched is not None and self.prefetched[0] == r
        segments = self.prefetched[1] if ready else round_batches(setup, r, self.secret)
        self.prefetched = None
        weights = np.asarray([len(setup.partition.clients[i].train) for i in sampled], np.float32)
        own, new_local, result = self._run(plan, segments, weights)
        costs = round_costs(setup, self.paths, spec, segments, sampled)  # gathered, if need be
        self.positions += client_data.positions([s for seg in segments if seg is not None
                                            for s in seg])  # fmt: skip
        losses = np.asarray(result.train_loss, np.float64)  # waits for the round's last program
        self._store(r, sampled, own, new_local)
        t_train = time.perf_counter()  # the store wrote the new local parts: the whole round's
        record = self.strategy.record(plan, losses, weights, sampled, result.accepted,
                                      result.update_norms)  # fmt: skip
        if driver.due(r, setup.config.outputs.eval_every, self.rounds):
            trained = round_records.trained_clients(history, sampled.tolist())
            record.update(evaluate(setup, self.server_state, self.frozen, self.store, trained,
                                   last=r == self.rounds))  # fmt: skip
        record.update(round_records.cost_record(
            history, int(result.bytes_up), int(result.bytes_down), (t0, t_train,
            time.perf_counter()), costs, costs_mod.counted(self.paths, spec.trained),
            self.bert_fl_bytes, len(sampled),
        ))  # fmt: skip
        if record.get(self.metric) is not None and r < self.rounds:  # the last: by summary()
            self.plot([*history, record])
        return record

    def _run(self, plan: RoundPlan, segments: list[list[Any] | None], weights: np.ndarray
             ) -> tuple[np.ndarray, Any, rounds.RoundResult]:  # fmt: skip
        """Enqueues the plan's round over this process's clients (every sampled one, in one
        process), then builds the next round's batches while it runs: (this process's clients,
        their new local parts, the round's result)."""
        setup, config, sampled = self.setup, self.setup.config, plan.clients
        own = sampled[sorted(own_positions(setup, len(sampled)))]
        local_sampled = (jax.tree.map(jnp.asarray, self.store.load_stacked(own))
                         if len(own) else None)  # fmt: skip
        hook = None if self.progress is None else self.progress.training()
        # the run's key; run_round folds in the round counter and the clients' global ids
        self.server_state, new_local, result = rounds.run_round(
            plan.spec, self.server_state, local_sampled, weights, segments,
            jax.random.key(config.seed), client_ids=sampled, frozen=self.frozen,
            on_progress=hook, update_factors=safeguards.attack_factors(config, sampled),
            local_like=self.local_like, noise_key=plan.noise_key,
        )  # fmt: skip
        if plan.round < self.rounds:  # the round runs asynchronously: batch the next one
            self.prefetched = (plan.round + 1, round_batches(setup, plan.round + 1, self.secret))
        return own, new_local, result

    def _store(self, r: int, sampled: np.ndarray, own: np.ndarray, new_local: Any) -> None:
        """This process's clients' new local parts into the store, once every process's are."""
        if len(own):
            self.store.save(r, own, new_local)
        processes.barrier(f"round {r} stored")  # every process's clients are on disk
        self.store.trained(r, sampled)

    def checkpointed(self, r: int, kept: Sequence[int]) -> None:
        self.store.prune(min(kept))  # keep the versions the kept checkpoints need

    def summary(self, history: Sequence[dict[str, Any]], stats: driver.Stats) -> dict[str, Any]:
        # process 0 has written its last checkpoint and pruned the store before anyone counts
        processes.barrier("run written")

        run_dir = self.run_dir
        plot = self.plot(history)
        return {
            **pieces.summary(self.setup.config, self.setup.model, history, self.publish),
            **safeguards.summary(self.setup.config, list(history)),
            **costs_mod.summary(history),
            "majority_label": self.majority,  # the primary metric of the label priors, no model
            # the share of the positions training computed that were real tokens, over the
            # rounds this process ran (the rest is the fixed shapes' padding)
            "fill": (round(float(self.positions[0] / self.positions[1]), 4)
                     if self.positions[1] else None),  # fmt: skip
            "plot": None if plot is None else str(plot),
            "round_devices": len(rounds.round_devices(self.setup.model.round_spec)),
            "allocator": runtime.allocator(),  # the seconds depend on it
            # what a checkpoint costs: its files (the server state; the frozen part, once a run),
            # the client store's (every version a kept checkpoint may need), and the seconds spent
            "checkpoint_bytes": _bytes_under(run_dir / "checkpoints"),
            "client_store_bytes": 0 if self.store is None else self.store.nbytes(),
            "checkpoint_seconds": stats.checkpoint_seconds,
        }


def shared_secret(secret: ServerSecret | None) -> ServerSecret | None:
    """The run's server secret, the same in every process of a multi-process simulation (all of
    them are the server): process 0's."""
    if secret is None or processes.count() == 1:
        return secret
    return ServerSecret.from_array(
        np.frombuffer(processes.gather_bytes(secret.to_array().tobytes())[0], np.uint8)
    )


def run_experiment(
    config: ExperimentConfig | dict[str, Any],
    *,
    progress: bool = True,
    on_round_end: driver.RoundHook | None = None,
) -> dict[str, Any]:
    """Run (or with --resume, continue) one simulated federated experiment; returns the summary
    dict. Everything a user can get wrong (task, model depth, run directory, checkpoint)
    is checked before the first byte is written. `on_round_end(round, record)` is called after
    each round's record and checkpoint are on disk."""
    if isinstance(config, dict):
        config = resolve_config(overrides=config)
    pieces.check(config)
    runtime_cfg = config.runtime

    # before the first JAX computation: the CPU devices, and the processes' runtime
    group = (runtime_cfg.coordinator, runtime_cfg.num_processes, runtime_cfg.process_id)
    runtime.apply(runtime_cfg.cpu_devices, group)
    check_attention(runtime_cfg.attention, runtime_cfg.dtype, jax.default_backend())
    saved_config.check_run_dir(config)
    processes.barrier("run directory checked")  # by every process, before process 0 writes
    simulation = Simulation(build(config))
    return saved_config.drive(simulation, config, progress=progress, on_round_end=on_round_end)

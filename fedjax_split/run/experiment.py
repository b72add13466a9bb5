"""run_experiment(config): data -> partition -> model -> federated rounds -> outputs.

Importable (notebooks call it directly); the CLI in train.py is a thin wrapper. Everything a user
can get wrong is checked before the first byte is written to the output directory, so a bad
command never damages an existing run. Randomness is derived from the one seed and the round
number only (numpy: `default_rng([seed, round, purpose])`; JAX: `fold_in(key(seed), round)`), so a
run resumed from the checkpoint of round r continues exactly as the uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedjax_split.errors import UserError
from fedjax_split.run import outputs
from fedjax_split.run.config import (
    ExperimentConfig,
    resolve_config,
    trajectory_mismatch,
    validate,
    validate_critical_layer,
)

# `purpose` components of numpy seeds, so no two uses of the seed share a stream.
_SUBSAMPLE = 0  # purpose of the subsample's numpy seed (rounds uses 1 for sampling)
CLIENTS_DIR = "clients"  # the run's client store (sim/client_store.py)
WIRE_DTYPE = {"none": "float32", "fp16": "float16", "bf16": "bfloat16"}

RoundHook = Callable[[int, dict[str, Any]], None]


@dataclasses.dataclass
class Setup:
    """Everything a run needs in memory, built before any output is written."""

    config: ExperimentConfig
    task: Any
    critical_layer: int
    model_config: Any
    model_dir: Path | None
    apply: Callable[..., Any]
    examples: Any
    tokenized: Any  # the pool, flattened once (batching.pack)
    row_width: int | None  # packed attention rows: run-wide, from the pool's longest example
    partition: Any
    round_spec: Any
    server_state: Any
    local0: Any  # the local part every client starts from (pretrained, head seeded)
    frozen: Any  # one copy for every client, never trained or sent
    eval_batches: list[list[Any]]  # each client's test batches
    num_global: int
    num_local: int
    num_frozen: int
    prefetched: tuple[int, list[Any]] | None = None  # (round, its clients' training steps)
    store: Any = None  # sim.client_store.ClientStore of the run: each client's local part
    checkpoint_seconds: float = 0.0  # spent saving checkpoints (and pruning the store) this run

    def local_part(self, client: int) -> Any:
        """`client`'s local part now (the initial one before it trains, or without a store)."""
        return self.local0 if self.store is None else self.store.load(client)

    def local_sampled(self, clients: Sequence[int]) -> Any:
        """The sampled clients' local parts stacked [K]: only theirs are read into memory."""
        if self.store is None:
            raise ValueError("the setup has no client store; run_experiment gives it one")
        return self.store.load_stacked(clients)

    def keep(self, round_: int, clients: Sequence[int], stacked: Any) -> None:
        """Writes the sampled clients' new local parts to the store (round_'s versions)."""
        if self.store is None:
            raise ValueError("the setup has no client store; run_experiment gives it one")
        self.store.save(round_, clients, stacked)


def round_chunk_size(chunk_size: int | None, backend: str) -> int | None:
    """Clients trained at once in a round: as configured, else one at a time on a CPU and all at
    once on an accelerator. Why: on a CPU each matmul already fills the cores, and the vmapped
    round holds every client's state at once; it ran 2x slower there (docs/benchmarks.md)."""
    if chunk_size is not None:
        return chunk_size
    return 1 if backend == "cpu" else None


def subsample_indices(n: int, max_examples: int | None, seed: int) -> np.ndarray | None:
    """Indices of a uniform subsample (sorted, so the pool keeps its order), or None for all."""
    if max_examples is None or max_examples >= n:
        return None
    rng = np.random.default_rng([seed, 0, _SUBSAMPLE])
    return np.sort(rng.choice(n, size=max_examples, replace=False))


def _subset_examples(examples: Any, idx: np.ndarray | None) -> Any:
    if idx is None:
        return examples

    def take(seq: Any) -> Any:
        if seq is None:
            return None
        if isinstance(seq, np.ndarray):
            return seq[idx]
        return [seq[i] for i in idx]

    changes = {
        f: take(getattr(examples, f))
        for f in ("texts_a", "texts_b", "tokens", "tags", "labels", "groups", "splits")
        if hasattr(examples, f)
    }
    if dataclasses.is_dataclass(examples):
        return dataclasses.replace(examples, **changes)
    return examples._replace(**changes)


def _check_run_dir(config: ExperimentConfig) -> None:
    run_dir = config.run_dir
    outputs.check_run_dir(
        run_dir, config.resume, outputs.existing_results(run_dir),
        lambda saved: trajectory_mismatch(saved, config),
    )  # fmt: skip


def check(config: ExperimentConfig) -> int:
    """Cheap checks of a config against the task registry and the model's depth (reads only the
    model's config.json); returns the critical layer as an int in 0..L."""
    from fedjax_split.models import hf_checkpoint
    from fedjax_split.tasks import registry as tasks

    validate(config)
    tasks.get_task(config.task)
    model_config = hf_checkpoint.load_config(hf_checkpoint.resolve_model(config.model))
    return validate_critical_layer(config, model_config.num_hidden_layers)


def load_pool(config: ExperimentConfig, task: Any) -> Any:
    """The task's example pool as every client sees it: loaded, then subsampled (--max-examples).
    A token task's tag vocabulary (`tag_names`) is the whole pool's, taken before subsampling."""
    from fedjax_split.data import sources

    examples = sources.load_examples(task, data_dir=config.data_dir)
    idx = subsample_indices(len(examples.labels), config.max_examples, config.seed)
    return _subset_examples(examples, idx)


def load_model(config: ExperimentConfig, task: Any, tag_names: Sequence[str] = ()) -> Any:
    """The pretrained model with the task's head (seeded by the run's seed); a token task's head
    has one output per tag of the pool."""
    from fedjax_split.models import hf_checkpoint

    tag_names = tuple(tag_names)
    return hf_checkpoint.load_pretrained(
        config.model,
        num_labels=len(tag_names) if tag_names else task.num_labels,
        seed=config.seed,
        problem_type="regression" if task.is_regression else None,
        dtype=config.dtype,
        attention=config.attention,
        head=task.objective.head,
        label_names=tag_names,
    )


def make_partition(config: ExperimentConfig, task: Any, labels: np.ndarray) -> Any:
    """The clients' train/test split of the pool; a client without training examples is a
    UserError."""
    from fedjax_split.data import partition

    part = partition.partition_clients(
        labels,
        scheme=config.partition,
        num_clients=config.clients,
        seed=config.seed,
        alpha=config.alpha if config.partition == "dirichlet" else None,
        beta=config.beta if config.partition == "quantity" else None,
        # a token task partitions by each sentence's dominant entity type, not by its tags
        task=None if task.objective.per_token else task,
        fill=config.paper_fill,
    )
    for i, cs in enumerate(part.clients):
        if len(cs.train) == 0:
            raise UserError(
                f"client {i} got no training examples ({len(labels)} examples for "
                f"{config.clients} clients); use more data (--max-examples) or fewer --clients"
            )
    return part


def model_parts(config: ExperimentConfig, pre: Any, critical_layer: int) -> Any:
    """The model's parameters by role (global, local, frozen): the critical layer's split with
    --freeze over the Hugging Face tensor names."""
    from fedjax_split.fed import roles
    from fedjax_split.models import hf_checkpoint

    model_config = pre.config
    names = {path: name for path, (name, _) in hf_checkpoint.hf_names(model_config).items()}
    rule = roles.freeze_rule(
        roles.critical_layer_rule(critical_layer, model_config.num_hidden_layers),
        config.freeze,
        names,
    )
    return roles.partition(pre.params, rule)


def make_round_spec(config: ExperimentConfig, apply: Callable[..., Any], task: Any) -> Any:
    """The round's static description: client update (objective, AdamW, FedProx mu), server
    optimiser, wire dtype, clients at once, devices."""
    import jax

    from fedjax_split.fed import algorithms, client
    from fedjax_split.sim import devices, rounds

    client_spec = client.ClientSpec(
        apply=apply,
        objective=task.objective,
        optimizer=client.default_client_optimizer(config.lr),
        prox_mu=config.prox_mu,
    )
    return rounds.RoundSpec(
        client=client_spec,
        server_optimizer=algorithms.server_optimizer(config.algorithm, config.effective_server_lr),
        wire_dtype=WIRE_DTYPE[config.quantize],
        chunk_size=round_chunk_size(config.chunk_size, jax.default_backend()),
        devices=devices.for_rounds(config.cpu_devices, jax.default_backend()),
    )


def load_tokenized(config: ExperimentConfig, task: Any, examples: Any, pre: Any) -> Any:
    """The pool tokenised with the model's tokenizer and flattened once (`batching.pack`)."""
    from fedjax_split.data import batching, sources, tokenization

    model_dir = getattr(pre, "model_dir", None)
    tokenizer = tokenization.load_tokenizer(model_dir if model_dir is not None else config.model)
    return batching.pack(sources.tokenize_examples(examples, tokenizer, task, config.max_length))


def row_width(config: ExperimentConfig, tokenized: Any) -> int | None:
    """Packed batches' attention rows: run-wide, from the pool's longest example (None: padded)."""
    from fedjax_split.data import batching

    return batching.default_row_width(tokenized) if config.packing else None


def eval_batch_size(config: ExperimentConfig) -> int:
    """Evaluation batches: at least 32 examples (no gradients to hold)."""
    return max(config.batch_size, 32)


def client_steps(
    config: ExperimentConfig,
    task: Any,
    tokenized: Any,
    labels: np.ndarray,
    width: int | None,
    indices: np.ndarray,
    client_id: int,
    r: int,
) -> list[Any]:
    """Round r's training steps of one client: a pure function of the config, r, the client's
    id and its own examples (what a federated client builds alone)."""
    from fedjax_split.data import batching

    return batching.client_batches(
        tokenized,
        indices,
        labels,
        batch_size=config.batch_size,
        epochs=config.local_epochs,
        seed=[config.seed, r],
        client_id=int(client_id),
        objective=task.objective,
        packing=config.packing,
        bucketing=config.bucketing,
        row_width=width,
    )


def client_eval_steps(
    config: ExperimentConfig,
    task: Any,
    tokenized: Any,
    labels: np.ndarray,
    width: int | None,
    indices: np.ndarray,
) -> list[Any]:
    """One client's test batches (its own examples, once each, sorted by length)."""
    from fedjax_split.data import batching

    return batching.client_eval_batches(
        tokenized,
        indices,
        labels,
        batch_size=eval_batch_size(config),
        objective=task.objective,
        packing=config.packing,
        row_width=width,
    )


def build(config: ExperimentConfig) -> Setup:
    """Load task, data, model; partition, tokenise, split, initialise. Writes nothing."""
    import jax

    from fedjax_split.sim import rounds
    from fedjax_split.tasks import registry as tasks

    task = tasks.get_task(config.task)
    # the data first: a token task's tag vocabulary (from the whole pool) sizes the model's head
    examples = load_pool(config, task)
    pre = load_model(config, task, getattr(examples, "tag_names", ()))
    model_config = pre.config
    c = validate_critical_layer(config, model_config.num_hidden_layers)
    labels = np.asarray(examples.labels)
    part = make_partition(config, task, labels)
    model_dir = getattr(pre, "model_dir", None)
    tokenized = load_tokenized(config, task, examples, pre)
    width = row_width(config, tokenized)

    global0, local0, frozen = model_parts(config, pre, c)
    round_spec = make_round_spec(config, pre.apply, task)
    server_state = rounds.init_server_state(
        global0, round_spec.server_optimizer, round_spec.wire_dtype
    )
    eval_batches = [
        client_eval_steps(config, task, tokenized, labels, width, cs.test) for cs in part.clients
    ]
    count = lambda t: int(sum(np.size(x) for x in jax.tree.leaves(t)))  # noqa: E731
    return Setup(
        config=config,
        task=task,
        critical_layer=c,
        model_config=model_config,
        model_dir=Path(model_dir) if model_dir is not None else None,
        apply=pre.apply,
        examples=examples,
        tokenized=tokenized,
        row_width=width,
        partition=part,
        round_spec=round_spec,
        server_state=server_state,
        local0=local0,
        frozen=frozen,
        eval_batches=eval_batches,
        num_global=count(global0),
        num_local=count(local0),
        num_frozen=count(frozen),
    )


def evaluate(setup: Setup, trained: set[int] | None = None) -> dict[str, Any]:
    """Personalised evaluation: each client's merged model on its own test split.

    Returns the task's metrics as the unweighted mean over all clients (the paper's figure), a
    per-client list, `trained_mean`: the mean over the clients in `trained` (those trained at least
    once: with partial participation the mean over all includes clients that never trained), and
    when nothing is local, `pooled`: the one global model on the union of the clients' test data
    (FedNLP's figure; with a local part there is no single global model to score). Clients are
    scored one at a time, so one local part is in memory at a time.
    """
    import jax.numpy as jnp

    from fedjax_split.fed import roles, wire
    from fedjax_split.sim import evaluation

    # the server holds the global part in the wire dtype; clients cast what they receive to fp32
    global_params = roles.merge_params(
        wire.cast_from_wire(setup.server_state.global_params, jnp.float32), setup.frozen
    )
    results, per_client = [], []
    for i, own in enumerate(setup.eval_batches):
        params = roles.merge_params(global_params, setup.local_part(i))
        res = evaluation.evaluate_client(setup.apply, params, own, setup.task.objective)
        if len(res.labels) == 0:
            continue  # a client without test examples has no metric
        results.append(res)
        per_client.append({"client": i, **score(setup.task, setup.examples, res)})
    record = {**mean_over_clients(per_client), "clients": per_client}
    if trained is not None:
        record["trained_mean"] = mean_over_clients(
            [pc for pc in per_client if pc["client"] in trained]
        )
    if setup.num_local == 0 and results:  # every client's model is the global model
        pooled = evaluation.ClientPredictions(
            *(evaluation.concat_rows([getattr(r, f) for r in results])
              for f in ("predictions", "labels", "example_index"))
        )  # fmt: skip
        record["pooled"] = score(setup.task, setup.examples, pooled)
    return record


def score(task: Any, examples: Any, res: Any) -> dict[str, float]:
    """The task's metrics of one set of predictions (MNLI's groups by each row's pool index, a
    token task's entities by the pool's tag names)."""
    from fedjax_split.tasks import registry as tasks

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


def _state(setup: Setup) -> dict[str, Any]:
    """What a checkpoint holds: the server's state and the frozen part (when there is one), so
    that an export needs nothing but the run directory. The clients' local parts are not copied
    into it: they are versioned in the run's client store (`clients/`, sim/client_store.py)."""
    state = {"server_state": setup.server_state}
    return {**state, "frozen": setup.frozen} if setup.frozen else state


def run_experiment(
    config: ExperimentConfig | dict[str, Any],
    *,
    progress: bool = True,
    on_round_end: RoundHook | None = None,
) -> dict[str, Any]:
    """Run (or with config.resume, continue) one federated experiment; returns the summary dict.

    `on_round_end(round, record)` is called after each round's record and checkpoint are on disk
    (tests use it to interrupt a run).
    """
    if isinstance(config, dict):
        config = resolve_config(overrides=config)
    check(config)
    import jax

    from fedjax_split.models.bert import check_attention
    from fedjax_split.run import xla_cache
    from fedjax_split.sim.devices import use_cpu_devices

    xla_cache.enable()  # a second run loads what the first compiled
    use_cpu_devices(config.cpu_devices)  # before the first JAX computation (see devices.py)
    check_attention(config.attention, config.dtype, jax.default_backend())
    _check_run_dir(config)
    setup = build(config)
    run_dir = config.run_dir

    from fedjax_split.data import partition as partition_mod
    from fedjax_split.data import sources
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

    checkpointer = RunCheckpointer(checkpoint_dir(run_dir))
    start_round, history = 0, []
    ck_dir = checkpoint_dir(run_dir)
    if config.resume and checkpointer.latest_round() is None:
        # Without a checkpoint, --resume may only restart a run that finished no round.
        if (ck_dir.is_dir() and any(ck_dir.iterdir())) or outputs.read_jsonl(
            run_dir / "metrics.jsonl"
        ):
            raise UserError(
                f"no readable checkpoint in {str(ck_dir)!r} to resume from; delete the run to "
                "start over, or use another --output-dir"
            )
    if config.resume and checkpointer.latest_round() is not None:
        state, meta = checkpointer.restore(_state(setup))
        setup.server_state = state["server_state"]
        setup.frozen = state.get("frozen", setup.frozen)
        if not (run_dir / CLIENTS_DIR / "initial.npz").is_file():
            raise UserError(
                f"{str(run_dir)!r} has no client store ({CLIENTS_DIR}/): it was written by an "
                "older version; start a new run in another --output-dir"
            )
        start_round, history = int(meta["round"]), list(meta["history"])
        saved_model = meta.get("model_config")
        if saved_model is not None and saved_model != setup.model_config.to_hf_dict():
            raise UserError(
                "--resume: the model's config differs from the checkpoint's; use the saved "
                "--model or another --output-dir"
            )
        saved_clients = [[list(c["train"]), list(c["test"])] for c in meta["partition"]]
        if saved_clients != _partition_lists(setup.partition):
            raise UserError(
                "--resume: the data or partition differ from the checkpoint's; use the same "
                "--data-dir/--max-examples/--seed or another --output-dir"
            )

    # From here on we write.
    from fedjax_split.sim.client_store import ClientStore

    run_dir.mkdir(parents=True, exist_ok=True)
    if start_round:  # versions written after the checkpoint are redone
        setup.store = ClientStore(run_dir / CLIENTS_DIR)
        setup.store.rewind(start_round)
    else:  # a fresh run (or one that finished no round): no checkpoint needs what is there
        setup.store = ClientStore.create(run_dir / CLIENTS_DIR, setup.local0)
    outputs.write_json(run_dir / "config.json", config.to_dict())
    partition_mod.save_partition(
        setup.partition, run_dir / "partition.json", np.asarray(setup.examples.labels)
    )
    outputs.write_jsonl(run_dir / "metrics.jsonl", history)  # on --resume: truncated to the ckpt
    if start_round < config.rounds:
        (run_dir / "summary.json").unlink(missing_ok=True)  # stale until this run ends
    report = partition_mod.partition_report(
        setup.partition,
        np.asarray(setup.examples.labels),
        sources.label_names_or_none(setup.task, setup.examples),
    )
    bar = outputs.Progress(config.rounds, start_round, enabled=progress)
    bar.note(
        f"{config.task}: {len(setup.examples.labels)} examples, {config.clients} clients, "
        f"{config.algorithm}, critical layer {setup.critical_layer}/"
        f"{setup.model_config.num_hidden_layers}, {setup.num_global:,} global / "
        f"{setup.num_local:,} local parameters per client"
        + (f" / {setup.num_frozen:,} frozen" if setup.num_frozen else "")
        + (f"; resuming after round {start_round}" if start_round else "")
    )
    if not start_round:
        bar.note(report)

    meta_static = {
        "seed": config.seed,
        "partition": [{"train": tr, "test": te} for tr, te in _partition_lists(setup.partition)],
        "model_config": setup.model_config.to_hf_dict(),
        "model_dir": None if setup.model_dir is None else str(setup.model_dir),
        "critical_layer": setup.critical_layer,
    }
    try:
        for r in range(start_round + 1, config.rounds + 1):
            record = run_one_round(setup, r, history)
            history.append(record)
            outputs.append_jsonl(run_dir / "metrics.jsonl", record)
            if config.checkpoint_every and (r % config.checkpoint_every == 0 or r == config.rounds):
                t_ck = time.perf_counter()
                checkpointer.save(r, _state(setup), {**meta_static, "history": history})
                setup.store.prune(min(checkpointer.all_rounds()))
                setup.checkpoint_seconds += time.perf_counter() - t_ck
            bar.round_done(record, setup.task.primary_metric)
            if on_round_end is not None:
                on_round_end(r, record)
    finally:
        bar.close()
        checkpointer.close()
    summary = make_summary(setup, history)
    outputs.write_json(run_dir / "summary.json", summary)
    return summary


def _partition_lists(part: Any) -> list[list[list[int]]]:
    return [[np.asarray(c.train).tolist(), np.asarray(c.test).tolist()] for c in part.clients]


def round_batches(setup: Setup, r: int) -> list[list[Any]]:
    """Round r's training steps of each sampled client (a pure function of the config, r and the
    client's own examples)."""
    from fedjax_split.sim import rounds

    config = setup.config
    sampled = rounds.sample_clients(config.clients, config.sampled_clients, config.seed, r)
    labels = np.asarray(setup.examples.labels)
    return [
        client_steps(config, setup.task, setup.tokenized, labels, setup.row_width,
                     setup.partition.clients[i].train, int(i), r)  # fmt: skip
        for i in sampled
    ]


def run_one_round(setup: Setup, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sample clients, batch their data, run the round, evaluate when due; the round's record.
    `history`: the records of the rounds before r."""
    import jax

    from fedjax_split.sim import rounds

    config = setup.config
    t0 = time.perf_counter()
    sampled = rounds.sample_clients(config.clients, config.sampled_clients, config.seed, r)
    train_idx = [setup.partition.clients[i].train for i in sampled]
    if setup.prefetched is not None and setup.prefetched[0] == r:
        segments = setup.prefetched[1]
    else:
        segments = round_batches(setup, r)
    setup.prefetched = None
    num_examples = np.asarray([len(t) for t in train_idx], np.float32)
    local_sampled = jax.tree.map(jax.numpy.asarray, setup.local_sampled(sampled))
    # the run's key; run_round folds in the round counter and the clients' global ids
    setup.server_state, new_local, result = rounds.run_round(
        setup.round_spec,
        setup.server_state,
        local_sampled,
        num_examples,
        segments,
        jax.random.key(config.seed),
        client_ids=sampled,
        frozen=setup.frozen,
    )
    if r < config.rounds:  # the round runs asynchronously: batch the next one meanwhile
        setup.prefetched = (r + 1, round_batches(setup, r + 1))
    losses = np.asarray(result.train_loss, np.float64)  # waits for the round's last program
    setup.keep(r, sampled, new_local)
    # keep() wrote the new local parts (waiting for them), so that t_train is the whole round's
    t_train = time.perf_counter()
    record: dict[str, Any] = {
        "round": r,
        "clients_sampled": sampled.tolist(),
        "train_loss": float(np.sum(losses * num_examples) / np.sum(num_examples)),
        "train_loss_clients": losses.tolist(),
    }
    if r % config.eval_every == 0 or r == config.rounds:
        trained = {int(c) for h in history for c in h["clients_sampled"]} | set(sampled.tolist())
        record.update(evaluate(setup, trained))
    t_eval = time.perf_counter()
    record.update(round_costs(history, int(result.bytes_up), int(result.bytes_down),
                              t0, t_train, t_eval))  # fmt: skip
    return record


def round_costs(
    history: list[dict[str, Any]],
    bytes_up: int,
    bytes_down: int,
    t0: float,
    t_train: float,
    t_eval: float,
) -> dict[str, Any]:
    """A round record's bytes (this round's and, with `history`, cumulative) and seconds; the
    simulation and the Flower server (deploy.server) write the same fields."""
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


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def make_summary(setup: Setup, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run at a glance: final and best primary metric, bytes, time, sizes."""
    from fedjax_split.run import malloc
    from fedjax_split.sim import rounds

    metric = setup.task.primary_metric
    evaluated = [h for h in history if h.get(metric) is not None and np.isfinite(h[metric])]
    last = history[-1] if history else {}
    final_eval = evaluated[-1] if evaluated else {}
    best = max(evaluated, key=lambda h: h[metric]) if evaluated else {}
    return {
        "task": setup.config.task,
        "algorithm": setup.config.algorithm,
        "critical_layer": setup.critical_layer,
        "num_layers": setup.model_config.num_hidden_layers,
        "rounds": len(history),
        "primary_metric": metric,
        "final": {k: v for k, v in final_eval.items() if k not in ("clients_sampled",)},
        "best_round": best.get("round"),
        "best": best.get(metric),
        "cum_bytes_up": last.get("cum_bytes_up", 0),
        "cum_bytes_down": last.get("cum_bytes_down", 0),
        "cum_bytes": last.get("cum_bytes", 0),
        "seconds": float(sum(h["seconds"] for h in history)),
        # a run resumed from records written before the split counts their parts as 0
        "train_seconds": float(sum(h.get("train_seconds", 0.0) for h in history)),
        "eval_seconds": float(sum(h.get("eval_seconds", 0.0) for h in history)),
        "round_devices": len(rounds.round_devices(setup.round_spec)),
        "allocator": malloc.allocator(),  # the seconds depend on it (fedjax_split.run.malloc)
        "global_params": setup.num_global,
        "local_params_per_client": setup.num_local,
        "frozen_params": setup.num_frozen,
        "run_dir": str(setup.config.run_dir),
        # what a checkpoint costs: its files (the server state, the frozen part), the client
        # store's (every version a kept checkpoint may need), and the seconds spent this process
        "checkpoint_bytes": _bytes_under(setup.config.run_dir / "checkpoints"),
        "client_store_bytes": 0 if setup.store is None else setup.store.nbytes(),
        "checkpoint_seconds": setup.checkpoint_seconds,
    }

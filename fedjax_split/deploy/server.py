"""The server of a real federation: rounds over a Flower Grid, written to a run directory as
`train` writes it.

Each round the run's `fed.strategy.Strategy` (the simulation's too) decides and this moves the
arrays: its plan samples clients as the simulation does (Poisson with client-level DP), sets the
round's spec, clip norm and noise key; the server sends each sampled client's SuperNode the global
part in the wire dtype (as bits, `deploy.codec`; with DP, the round's clip norm, to which the
client clips its update), waits for the replies up to `round_timeout`, validates and decodes the
uploads to fp32 and steps the server with the strategy's `aggregate`
(`fed.server_step.server_round`, the simulation's one-at-a-time seam: `fed.aggregation`'s
example-weighted mean in fp32 and client order, a robust rule, or DP's clipped sum plus Gaussian
noise from the server's key, then `server_update`: Delta against the copy sent, any optax server
optimiser on the fp32 master); Flower's own strategies and FedAvg are not used. The aggregator's
state (DP's clip norm) is part of the checkpointed server state; epsilon is a function of the
rounds done. Then, when due, every client evaluates the new global part with its own local part
on its own test split; before the last round in the same exchange as round r+1's training
(`deploy.evaluation.evaluate`: one exchange a round, the replies of round r+1 held until it
starts, so that round r's record is whole first).

Faults: a client that does not answer within `round_timeout` (its SuperNode died, or Flower
reported an error for it) is left out of the round: the mean is over the replies received, weighted
by their example counts, and the round's record lists it in `clients_failed` (in `eval_failed` when
it failed to evaluate). A reply whose upload is malformed (paths, shapes, dtypes), not finite, or
whose figures are not (its example count must be the one its node reported when it joined) is left
out too and listed in `clients_rejected`; the round goes on without it (a round whose every reply
was rejected stops the run: `run.driver`). An evaluate reply that is not the client's own metrics
(the task's names, real numbers or NaN) is left out of the evaluation and listed in `eval_failed`.
A query reply whose indices, sizes or settings are not a share of the data
(`deploy.joining.partition_from_nodes`) stops the run before round 1 with one line naming the
SuperNode. A round in which no sampled client replies stops the run with a one-line error; its last
checkpoint stays and `--resume` continues from it.

The server holds no client data and no local part: a node's query reply tells its client id, its
share of the pool (indices, for partition.json) and sizes (with --site-data: its count of its own
rows and its label shares; the server never learns where a site's files are, let alone opens
them); checkpoints hold the server state and the run's id, by which each node finds its own local
parts again after a restart (it keeps those of the oldest kept checkpoint on).

This module is the top: the run loop's `driver.Run` (`FlowerServer`) and `run_server`. The rest
has a module an idea: `deploy.messaging` (the options, the exchange over the Grid),
`deploy.joining` (what the nodes report when they join; the server's side of the run),
`deploy.rounds` (a round), `deploy.train_messages` (what a round sends), `deploy.train_replies`
(what it takes from the replies) and `deploy.evaluation` (a round's evaluation).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fedjax_split import runtime
from fedjax_split.data import partition as partition_mod
from fedjax_split.deploy.joining import ServerRun, build_server, connect, partition_names
from fedjax_split.deploy.messaging import DeployOptions, Exchange, Stopped
from fedjax_split.deploy.rounds import run_round
from fedjax_split.deploy.train_messages import Ahead
from fedjax_split.errors import UserError
from fedjax_split.fed.secret import CHECKPOINT_KEY, ServerSecret
from fedjax_split.run import client_data, costs, pieces, plots, safeguards, saved_config
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
from fedjax_split.run.config import ExperimentConfig


def oldest_checkpoint(run_dir: Any, start_round: int) -> int:
    """The oldest checkpoint's round in `run_dir` when a run resumes after `start_round` (the
    older checkpoints it kept may be resumed from or exported too, so the nodes must keep their
    local parts), else `start_round`."""
    if not start_round or not checkpoint_dir(run_dir).is_dir():
        return start_round
    return min(RunCheckpointer(checkpoint_dir(run_dir)).all_rounds(), default=start_round)


class FlowerServer:
    """The Flower server's `driver.Run`: rounds over the federation; checkpoints hold the server
    state and the run's id, by which each node finds its own local parts again."""

    per_run = ("frozen",)  # as the simulation's: the frozen part stored once per run

    def __init__(self, run: ServerRun, exchange: Exchange, options: DeployOptions) -> None:

        self.run = run
        self.exchange = exchange
        self.options = options
        self.run_dir = run.config.run_dir
        self.rounds = run.rounds
        self.metric = run.model.task.primary_metric
        # the oldest kept checkpoint's round: nodes keep the local parts every kept checkpoint
        # needs (`sim.client_store.prune`, as the simulation prunes its store to min(kept))
        self.keep_from = 0
        self.publish = safeguards.publisher(run.config)  # DP: the per-client figures kept private
        self.ahead: Ahead | None = None  # the next round's training, exchanged with this one's

    def arrays(self) -> dict[str, Any]:
        """The server state and, as the simulation's checkpoint has it, the frozen part (when
        there is one), so that an export needs nothing but the checkpoint and the client's local
        part; the local parts are on the nodes. With DP, the server's secret too (the checkpoint
        is the server's alone), so that --resume draws the noise a straight run would."""
        frozen = self.run.model.frozen

        secret = {} if self.run.secret is None else {CHECKPOINT_KEY: self.run.secret.to_array()}
        return {"server_state": self.run.server_state, **secret,
                **({"frozen": frozen} if frozen else {})}  # fmt: skip

    def meta(self) -> dict[str, Any]:

        run = self.run
        meta = pieces.checkpoint_meta(run.config, run.model, run.partition)
        return {**meta, "deploy": "flower", "run_id": run.run_id}

    def resume(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:

        if meta.get("deploy") != "flower" or "run_id" not in meta:
            raise UserError(
                "--resume: this run was not written by the Flower server (its clients' local "
                "parts are in its client store); continue it with `python -m fedjax_split.train`"
            )
        client_data.check_partition(meta, self.run.partition, "the nodes' data")
        self.run.server_state = arrays["server_state"]
        if self.run.secret is not None:
            self.run.secret = ServerSecret.from_array(arrays[CHECKPOINT_KEY])
        self.run.run_id = str(meta["run_id"])

    def start(self, start_round: int, note: Callable[[str], None]) -> None:

        run, config, model = self.run, self.run.config, self.run.model
        self.keep_from = oldest_checkpoint(self.run_dir, start_round)
        names = partition_names(config, model.task)
        partition_mod.save_partition(run.partition,
                                     safeguards.partition_path(config, self.run_dir),
                                     realised=run.shares, label_names=names)  # fmt: skip
        where = f"{config.data.task} on Flower: {config.federation.clients} SuperNodes"
        for line in pieces.start_notes(config, model, self.rounds, start_round, where):
            note(line)

    def step(self, r: int, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Round r's record, complete (its evaluation too) before the driver writes it; round
        r+1's training, where it went in the same exchange, waits here for step r+1."""
        ahead, self.ahead = self.ahead, None
        record, self.ahead = run_round(self.run, self.exchange, r, list(history), self.options,
                                       self.keep_from, ahead)  # fmt: skip
        return record

    def checkpointed(self, r: int, kept: Sequence[int]) -> None:
        self.keep_from = min(kept, default=r)

    def summary(self, history: Sequence[dict[str, Any]], stats: Any) -> dict[str, Any]:

        # the labels are on the nodes: the plot has no majority-label line
        plot = plots.write_fine_tuning_plot(self.run_dir, history, self.run.config, self.run.model,
                                            publish=self.publish)  # fmt: skip
        return {
            **pieces.summary(self.run.config, self.run.model, history, self.publish),
            **safeguards.summary(self.run.config, list(history)),
            **costs.summary(history),
            "plot": None if plot is None else str(plot),
            "allocator": runtime.allocator(),
            "checkpoint_seconds": stats.checkpoint_seconds,
            "deploy": "flower",
            "supernodes": len(self.run.nodes),
        }


def run_server(
    grid: Any,
    config: ExperimentConfig,
    options: DeployOptions,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """The whole run (or with --resume, its continuation) over `grid`; the summary dict.

    Writes the run directory as `train` does: config.json, partition.json, metrics.jsonl,
    summary.json, checkpoints/ (server state; the clients' local parts stay on their nodes).
    Raises Stopped after the checkpoint of `options.stop_after_round`."""
    pieces.check(config)
    safeguards.check_deployable(config)
    saved_config.check_run_dir(config)
    run = build_server(config, connect(grid, config, options))

    def stop(round_: int, record: dict[str, Any]) -> None:
        if options.stop_after_round == round_:
            raise Stopped(round_)

    server = FlowerServer(run, Exchange(grid, options), options)
    return saved_config.drive(server, config, progress=progress, on_round_end=stop)

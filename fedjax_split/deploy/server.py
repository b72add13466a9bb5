"""The server of a real federation: rounds over a Flower Grid, written to a run directory as
`train` writes it.

Each round the run's `fed.strategy.Strategy` (the simulation's too) decides and this moves the
arrays: its plan samples clients as the simulation does (Poisson with client-level DP), sets the
round's spec, clip norm and noise key; the server sends each sampled client's SuperNode the global
part in the wire dtype (as bits, `codec`; with DP, the round's clip norm, to which the client clips
its update), waits for the replies up to `round_timeout`, validates and decodes the uploads to fp32
and steps the server with the strategy's `aggregate` (`fed.server_step.server_round`, the
simulation's one-at-a-time seam: `fed.aggregation`'s example-weighted mean in fp32 and client
order, a robust rule, or DP's clipped sum plus Gaussian noise from the server's key, then
`server_update`: Delta against the copy sent, any optax server optimiser on the fp32 master);
Flower's own strategies and FedAvg are not used. The aggregator's state (DP's clip norm) is part
of the checkpointed server state; epsilon is a function of the rounds done. Then,
when due, every client evaluates the new global part with its own local part on its own test split;
before the last round in the same exchange as round r+1's training (`evaluate`: one exchange a
round, the replies of round r+1 held until it starts, so that round r's record is whole first).

Faults: a client that does not answer within `round_timeout` (its SuperNode died, or Flower
reported an error for it) is left out of the round: the mean is over the replies received,
weighted by their example counts, and the round's record lists it in `clients_failed` (in
`eval_failed` when it failed to evaluate). A reply whose upload is malformed (paths, shapes,
dtypes), not finite, or whose figures are not (its example count must be the one its node
reported when it joined) is left out too and listed in `clients_rejected`; the round goes on
without it. An evaluate reply that is not the client's own metrics (the task's names, real
numbers or NaN) is left out of the evaluation and listed in `eval_failed`. A query reply whose
indices, sizes or settings are not a share of the data (`partition_from_nodes`) stops the run
before round 1 with one line naming the SuperNode. A round in which no sampled client replies
stops the run with a one-line error; its last checkpoint stays and `--resume` continues from it.

The server holds no client data and no local part: a node's query reply tells its client id, its
share of the pool (indices, for partition.json) and sizes (with --site-data: its count of its own
rows and its label shares; the server never learns where a site's files are, let alone opens
them); checkpoints hold the server state and the run's id, by which each node finds its own local
parts again after a restart (it keeps those of the oldest kept checkpoint on).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from fedjax_split import runtime
from fedjax_split.data import partition as partition_mod
from fedjax_split.data.partition import SITES, ClientSplit, Partition, sites_partition
from fedjax_split.data.tokens.tagged import NO_ENTITY
from fedjax_split.deploy import codec, protocol, secagg, secure_node, secure_round
from fedjax_split.errors import UserError
from fedjax_split.fed.aggregation import init_state
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.roles import flatten_paths, select
from fedjax_split.fed.secret import CHECKPOINT_KEY, ServerSecret
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import RoundPlan, Strategy
from fedjax_split.fed.wire import cast_from_wire, param_count
from fedjax_split.run import costs, driver, pieces, plots, safeguards
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
from fedjax_split.run.config import ExperimentConfig
from fedjax_split.run.saved_config import saved_dict, trajectory_mismatch
from fedjax_split.tasks import registry as tasks


@dataclasses.dataclass(frozen=True)
class DeployOptions:
    """How the server waits: for the nodes to connect, for each round's replies."""

    round_timeout: float = 600.0  # seconds a round (or an evaluation) waits for replies
    connect_timeout: float = 300.0  # seconds to wait for all K SuperNodes at the start
    poll_interval: float = 0.2  # seconds between two pulls of replies
    stop_after_round: int | None = None  # tests: stop (as Ctrl-C would) after this round
    # round r's evaluation in round r+1's train messages (`evaluate`); False: an exchange each
    carry_evaluation: bool = True


class Stopped(Exception):
    """The run stopped on request after a round's checkpoint (`stop_after_round`)."""

    def __init__(self, round_: int) -> None:
        super().__init__(f"stopped after round {round_}")
        self.round = round_


class Exchange:
    """Sends messages through a Flower Grid and collects the replies, per client, with a timeout.

    Flower's `send_and_receive` polls every 3 s; this pulls every `poll_interval` seconds, so a
    round does not wait for nothing."""

    def __init__(self, grid: Any, options: DeployOptions) -> None:
        self.grid = grid
        self.options = options

    def send(
        self, messages: Mapping[int, Any], timeout: float
    ) -> tuple[dict[int, Any], dict[int, str]]:
        """{client: reply} and {client: why it failed} for {client: message}."""
        sent = [protocol.record_sent(m, "server") for m in messages.values()]
        ids = list(self.grid.push_messages(sent))
        client_of = dict(zip(ids, messages, strict=True))
        pending = set(ids)
        replies: dict[int, Any] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                client = client_of[mid]
                if reply.has_error():
                    failed[client] = f"error {reply.error.code}: {reply.error.reason}"
                else:
                    replies[client] = reply
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.options.poll_interval)
        for mid in pending:
            failed[client_of[mid]] = f"no reply within {timeout:g} s"
        return replies, failed


def _config_record(values: Mapping[str, Any]) -> Any:
    from flwr.app import ConfigRecord

    return ConfigRecord(dict(values))


def _message(content: Mapping[str, Any], node_id: int, kind: str) -> Any:
    from flwr.app import Message, RecordDict

    return Message(RecordDict(dict(content)), dst_node_id=node_id, message_type=kind)


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def connect(
    grid: Any, config: ExperimentConfig, options: DeployOptions, query: str = protocol.QUERY
) -> dict[int, Any]:
    """Waits for the SuperNodes and asks each who it is: {client id: (node id, query reply)}.

    Every client id 0..K-1 must answer exactly once within `connect_timeout`, else UserError.
    `query`: the message type that asks (further pre-training's is "query.pretrain")."""
    fed = config.federation
    exchange = Exchange(grid, options)
    deadline = time.monotonic() + options.connect_timeout
    found: dict[int, tuple[int, Any]] = {}
    asked: set[int] = set()
    last_failures: dict[int, str] = {}
    while True:
        nodes = [n for n in grid.get_node_ids() if n not in asked]
        if nodes:
            asked.update(nodes)
            msgs = {n: _message({}, n, query) for n in nodes}
            replies, failures = exchange.send(msgs, max(1.0, deadline - time.monotonic()))
            last_failures.update(failures)
            broken = {n: why for n, why in failures.items() if why.startswith("error")}
            if broken:  # its ClientApp raised: asking again would only raise again
                node, why = next(iter(sorted(broken.items())))
                raise UserError(
                    f"SuperNode {node} could not set up its client ({why}); see its log"
                )
            for node_id, reply in replies.items():
                for cid, cfg in _clients_of(node_id, reply):
                    if cid in found:
                        raise UserError(
                            f"two SuperNodes say partition-id {cid}; give each a different one"
                        )
                    found[cid] = (node_id, cfg)
        missing = sorted(set(range(fed.clients)) - set(found))
        if not missing:
            break
        if time.monotonic() >= deadline:
            why = f" ({next(iter(last_failures.values()))})" if last_failures else ""
            raise UserError(
                f"clients {missing} did not connect within {options.connect_timeout:g} s{why}; "
                f"start SuperNodes that hold them, with --node-config 'partition-id=<0..."
                f"{fed.clients - 1}>' or 'partition-ids=A-B'"
            )
        time.sleep(options.poll_interval)
    extra = sorted(set(found) - set(range(fed.clients)))
    if extra:
        raise UserError(f"SuperNodes with partition-id {extra} but --clients {fed.clients}")
    return found


def _whole(value: Any) -> int | None:
    """`value` as an int where it is a whole number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def _bad_reply(node_id: int, what: str) -> UserError:
    """The one line for a query reply the server cannot use (a node of another version, or one
    that lies): a traceback would say nothing of which node to look at."""
    return UserError(f"SuperNode {node_id} answered the query with {what}; is it running this "
                     "version of fedjax_split?")  # fmt: skip


def _clients_of(node_id: int, reply: Any) -> list[tuple[int, Any]]:
    """[(client id, its query record)] of one node's query reply: the clients the node holds
    (`client-ids`, each with its own record), or the one client of a single-client reply."""
    if protocol.CONFIG not in reply.content.config_records:
        raise _bad_reply(node_id, "no config record")
    cfg = reply.content[protocol.CONFIG]
    if protocol.CLIENTS not in cfg:
        cid = _whole(cfg.get(protocol.CLIENT))
        if cid is None:
            raise _bad_reply(node_id, f"no client id ({protocol.CLIENT!r})")
        return [(cid, cfg)]
    ids = cfg[protocol.CLIENTS]
    if not isinstance(ids, list) or any(_whole(c) is None for c in ids):
        raise _bad_reply(node_id, f"client ids {str(ids)[:60]} that are not whole numbers")
    out = []
    for cid in (int(c) for c in ids):
        record = reply.content.config_records.get(protocol.client_record(cid))
        if record is None or _whole(record.get(protocol.CLIENT)) != cid:
            raise UserError(f"SuperNode {node_id} answered the query for client {cid} without "
                            "its record; is it running this version of fedjax_split?")  # fmt: skip
        out.append((cid, record))
    if not out:
        raise UserError(f"SuperNode {node_id} holds no client; give it a partition-id")
    return out


def _partition_meta(node_id: int, cfg: Any) -> dict[str, Any]:
    """One node's partition settings (its query's JSON), checked: an object of `Partition`'s
    settings with a scheme and whole-number counts (anything else would reach `Partition(**)`)."""
    fields = {f.name for f in dataclasses.fields(Partition)} - {"clients"}
    try:
        meta = json.loads(str(cfg[protocol.PARTITION]))
    except (KeyError, ValueError, RecursionError):
        raise _bad_reply(node_id, "no partition settings as JSON") from None
    if (not isinstance(meta, dict) or not set(meta) <= fields
            or not isinstance(meta.get("scheme"), str)
            or any(_whole(meta[k]) is None or meta[k] < 0 for k in
                   ("num_clients", "seed", "num_examples", "dropped") if k in meta)):  # fmt: skip
        raise _bad_reply(node_id, f"the partition settings {str(meta)[:80]}")
    return meta


def _client_split(node_id: int, cid: int, cfg: Any, size: int) -> Any:
    """One client's reported train and test indices, checked: whole numbers in [0, size), none
    twice (a repeat or one in both would count an example twice, or test on what it trained)."""
    parts = []
    for key in (protocol.SPLIT_TRAIN, protocol.SPLIT_TEST):
        value = cfg.get(key)
        if not isinstance(value, list) or any(_whole(i) is None for i in value):
            raise _bad_reply(node_id, f"client {cid}'s {key} indices not as whole numbers")
        if value and not (0 <= min(value) and max(value) < size):
            raise _bad_reply(node_id, f"client {cid}'s {key} indices outside 0..{size - 1}")
        parts.append(np.asarray(value, np.int64).reshape(-1))
    if np.unique(np.concatenate(parts)).size != sum(p.size for p in parts):
        raise _bad_reply(node_id, f"client {cid}'s indices repeated (or both train and test)")
    return ClientSplit(*parts)


def _check_disjoint(clients: Sequence[Any], found: Mapping[int, tuple[int, Any]]) -> None:
    """No pool example is two clients' (the simulation's partition shares none out)."""
    every = np.concatenate([np.concatenate([c.train, c.test]) for c in clients])
    owner = np.repeat(np.arange(len(clients)), [c.train.size + c.test.size for c in clients])
    order = np.argsort(every, kind="stable")
    twice = np.flatnonzero(every[order][1:] == every[order][:-1])
    if twice.size:
        a, b = (int(owner[order[twice[0] + j]]) for j in (0, 1))
        raise UserError(
            f"SuperNodes {found[a][0]} and {found[b][0]} both report pool example "
            f"{int(every[order][twice[0]])} (clients {a} and {b}); give them the same data"
        )


def partition_from_nodes(config: ExperimentConfig, found: Mapping[int, tuple[int, Any]]) -> Any:
    """The run's Partition as the nodes report it (pool indices, as partition.json holds them;
    sites with their own data report indices into their own rows, which the server offsets by
    the sizes the sites before them report, as the simulation concatenates them). Checked: one
    pool size (sites: each its own row count), indices within it, disjoint."""
    fed = config.federation
    metas = {json.dumps(_partition_meta(node_id, cfg), sort_keys=True)
             for node_id, cfg in found.values()}  # fmt: skip
    if len(metas) != 1:
        raise UserError("the SuperNodes partition the data differently; give them the same data")
    meta = json.loads(metas.pop())
    sizes = []
    for i in range(fed.clients):
        node_id, cfg = found[i]
        size = _whole(cfg.get(protocol.POOL_SIZE))
        if size is None or size < 0:
            raise _bad_reply(node_id, f"client {i}'s pool size {cfg.get(protocol.POOL_SIZE)!r}")
        sizes.append(size)
    sites = meta["scheme"] == SITES
    if not sites and len(set(sizes)) > 1:
        raise UserError(f"the SuperNodes report pools of {sorted(set(sizes))} examples; give "
                        "them the same data")  # fmt: skip
    clients = [_client_split(found[i][0], i, found[i][1], sizes[i]) for i in range(fed.clients)]
    if not sites:
        _check_disjoint(clients, found)
    try:
        if sites:
            return sites_partition(clients, sizes, int(meta["seed"]), meta["task"])
        if meta.get("target_shares") is not None:
            meta["target_shares"] = np.asarray(meta["target_shares"], np.float64)
        return Partition(clients=clients, **meta)
    except (KeyError, TypeError, ValueError) as err:
        raise _bad_reply(found[0][0], f"partition settings it lacks or mistypes ({err})") from None


def _tag_names(
    found: Mapping[int, tuple[int, Any]], configured: tuple[str, ...] = ()
) -> tuple[str, ...]:
    """A token task's tag vocabulary: the run config's (`configured`, pieces.tag_names), which
    every node must report too; without one (a pool's own tags), the one the nodes agree on."""
    for node_id, cfg in found.values():
        tags = cfg.get(protocol.TAG_NAMES, [])
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise _bad_reply(node_id, f"tag names {str(tags)[:60]} that are not strings")
    names = {tuple(cfg.get(protocol.TAG_NAMES, ())) for _, cfg in found.values()}
    if len(names) != 1:
        raise UserError("the SuperNodes report different tag vocabularies; give them the same data")
    reported = names.pop()
    if configured and reported != configured:
        raise UserError(
            f"the SuperNodes report the tags {','.join(reported)}, the run's are "
            f"{','.join(configured)}; give every node this run's fedjax_split and config"
        )
    return configured or reported


def partition_names(config: ExperimentConfig, task: Any) -> tuple[str, ...] | None:
    """The names of partition.json's share columns: the task's labels, or a token task's
    entity types from the config (each sentence's dominant type, then "(none)", as the pool's
    `partition_names`); None where no one knows them here (a pool's own types)."""
    if task.objective.per_token:
        types = pieces.entity_types(config, task)
        return None if types is None else (*types, NO_ENTITY)
    return task.label_names or None


@dataclasses.dataclass
class ServerRun:
    """The server's side of a run in memory: no data and no local part."""

    config: ExperimentConfig
    model: Any  # run.pieces.Model: the model, its roles and round spec, as every node builds it
    partition: Any  # the nodes' shares as they report them (pool indices, for partition.json)
    nodes: dict[int, int]  # client id -> Flower node id
    run_id: str  # ours: survives a restart (checkpoint meta), names the nodes' local parts
    server_state: Any
    shares: list[Any] | None = None  # each client's realised label shares, as its node reported
    rounds: int = 0  # the rounds to run: --rounds, or fewer where DP's --dp-max-epsilon stops it
    tag_names: tuple[str, ...] = ()  # a token task's tag vocabulary (its metrics' names)
    bert_fl_bytes: int | None = None  # with a layer schedule: the whole model's bytes (run.costs)
    paths: Any = None  # run.costs.ModelPaths of the model: what its FLOP counts need
    # client-level DP: the server's secret for its noise and Poisson sample (fed.secret); never
    # in a message to a node, in config.json or in a log; kept in the server's checkpoints
    secret: ServerSecret | None = None
    # the run's algorithm (fed.strategy): sampling, the round's plan, the server's step, record
    strategy: Strategy | None = None


def _shares(node_id: int, cfg: Any, cid: int) -> list[float] | None:
    """A client's realised label shares as its node reports them (JSON: null, or fractions),
    checked before partition.json records them."""
    try:
        value = json.loads(str(cfg[protocol.SHARES]))
    except (KeyError, ValueError, RecursionError):
        raise _bad_reply(node_id, f"client {cid}'s label shares not as JSON") from None
    if value is not None and (not isinstance(value, list) or not all(
            type(x) in (int, float) and 0 <= x <= 1 for x in value)):  # fmt: skip
        raise _bad_reply(node_id, f"client {cid}'s label shares {str(value)[:60]}")
    return value


def build_server(config: ExperimentConfig, found: Mapping[int, tuple[int, Any]]) -> ServerRun:
    """Model, roles and server state, as `run.pieces` makes them for every node, without data."""
    task = tasks.get_task(config.data.task)
    tag_names = _tag_names(found, pieces.tag_names(config, task))
    model = pieces.build_model(config, task, tag_names)
    spec = model.round_spec
    nodes = {cid: node_id for cid, (node_id, _) in found.items()}
    shares = [_shares(*found[i], i) for i in range(config.federation.clients)]
    return ServerRun(
        config=config,
        model=model,
        partition=partition_from_nodes(config, found),
        nodes=nodes,
        run_id=secrets.token_hex(16),
        server_state=init_server_state(model.global0, spec.server_optimizer, spec.wire_dtype,
                                       init_state(spec.aggregator)),  # fmt: skip
        shares=None if any(x is None for x in shares) else shares,
        rounds=safeguards.rounds_allowed(config),
        tag_names=tag_names,
        bert_fl_bytes=(None if model.cycle_factor is None
                       else costs.model_bytes(model, spec.wire_dtype)),  # fmt: skip
        paths=costs.paths_of(model),
        secret=safeguards.server_secret(config),
        strategy=safeguards.strategy(config, model.round_spec_for),
    )


def _decode_upload(
    reply: Any, expected: Mapping[str, Any], wire: str, dtypes: Mapping[str, np.dtype]
) -> Any:

    if protocol.UPLOAD not in reply.content.array_records:
        arrays: dict[str, np.ndarray] = {}
    else:
        arrays = codec.from_record(reply.content[protocol.UPLOAD])
    codec.check_like(arrays, expected, "upload", dtypes)
    return cast_from_wire(codec.decode(arrays, wire)), codec.nbytes(arrays)


def _train_messages(
    run: ServerRun, plan: RoundPlan, sent: Mapping[str, np.ndarray], keep_from: int,
    carry: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[int, Any]:  # fmt: skip
    """Round r's TRAIN message for each sampled client: the global part as sent, the round's
    config (the server state's round for the keys, the rounds whose local parts to keep, the
    paths a layer schedule trains this round, and with client-level DP the clip norm the client
    clips its update to). `carry`: {client: the config of round r-1's evaluation} for the
    clients whose message carries it (`evaluate`)."""
    spec, state, clip = plan.spec, run.server_state, plan.clip
    cfg = {
        protocol.ROUND: plan.round,
        protocol.STATE_ROUND: int(state.round),
        protocol.WIRE: spec.wire_dtype,
        protocol.RUN: run.run_id,
        protocol.KEEP_FROM: keep_from,
    }
    if spec.trained is not None:
        cfg[protocol.TRAINED] = sorted(spec.trained)
    if clip is not None:
        cfg[protocol.DP_CLIP] = clip
    msgs = {}
    for cid in plan.clients.tolist():
        extra = (carry or {}).get(cid, {})
        content = {protocol.CONFIG: _config_record({**cfg, **extra, protocol.CLIENT: cid})}
        if sent:
            content[protocol.GLOBAL] = codec.to_record(sent)
        msgs[cid] = _message(content, run.nodes[cid], protocol.TRAIN)
    return msgs


@dataclasses.dataclass
class Taken:
    """The uploads the server takes into a round, in client order."""

    clients: list[int] = dataclasses.field(default_factory=list)
    uploads: list[Any] = dataclasses.field(default_factory=list)  # fp32 trees
    weights: list[float] = dataclasses.field(default_factory=list)  # example counts
    losses: list[float] = dataclasses.field(default_factory=list)
    norms: list[float] | None = None  # DP: the update norms the clients report (before clipping)
    bytes_up: int = 0  # the taken uploads' bytes as sent
    costs: list[dict[str, int]] = dataclasses.field(default_factory=list)  # run.costs' figures
    secagg_bytes: int | None = None  # secure aggregation: the keys and shares the clients sent

    def add(self, cid: int, examples: int, loss: float, spent: dict[str, int], nbytes: int,
            upload: Any = None) -> None:  # fmt: skip
        """One client's reply taken (`upload` None: secure aggregation's, summed elsewhere)."""
        self.clients.append(cid)
        if upload is not None:
            self.uploads.append(upload)
        self.weights.append(examples)
        self.losses.append(loss)
        self.bytes_up += nbytes
        self.costs.append(spent)

    def answered(
        self, rejected: Mapping[int, str], valid: Any, norms: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The safeguards' view of the round, as the simulation has it: the clients that
        replied (taken or rejected, in client order), whether the server accepted each upload
        (`valid`: the server step's, over the taken ones; a rejected one never), each one's
        update norm (0 for a rejected one)."""
        answered = sorted([*self.clients, *rejected])
        accepted = dict(zip(self.clients, np.asarray(valid, bool).tolist(), strict=True))
        norm_of = dict(zip(self.clients, np.asarray(norms, np.float32).tolist(), strict=True))
        return (np.asarray(answered, np.int64),
                np.asarray([accepted.get(c, False) for c in answered], bool),
                np.asarray([norm_of.get(c, 0.0) for c in answered], np.float32))  # fmt: skip


def whole_count(metrics: Any, key: str) -> int:
    """A reply's whole-number figure, checked: present, an integer (FLOPs pass 2**53: no float
    on the way), >= 0."""
    value = metrics[key] if key in metrics else None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{key} {value!r} is not a whole number >= 0")
    return int(value)


def _number(metrics: Any, key: str, what: str, integral: bool = False) -> float:
    """A reply's metric, checked: present, finite, >= 0 (and a whole number where it counts)."""
    if key not in metrics:
        raise ValueError(f"no {what} ({key!r})")
    value = float(metrics[key])
    if not (np.isfinite(value) and value >= 0) or (integral and value != int(value)):
        kind = "whole number" if integral else "number"
        raise ValueError(f"{what} {value!r} is not a finite {kind} >= 0")
    return value


def expected_costs(run: ServerRun, spec: Any) -> tuple[str, ...]:
    """The FLOP counts every node's TRAIN reply must carry this round (as the simulation's
    clients count them: none where the roles train part of a layer)."""
    if not costs.counted(run.paths, spec.trained):
        return ()
    return ("flops", "bert_fl_flops") if run.model.cycle_factor is not None else ("flops",)


def _take_uploads(
    run: ServerRun, spec: Any, replies: Mapping[int, Any], rejected: dict[int, str],
    expect: tuple[str, ...] = (),
) -> Taken:  # fmt: skip
    """The replies whose upload decodes to the trained global part's paths, shapes and wire
    dtype with finite values, and whose figures are finite (the example count the node reported
    when it joined; with DP, an update norm), in client order; each other reply is added to
    `rejected` with why (a trust boundary: one NaN would spread through every client's model,
    one inflated example count would outweigh every other client)."""
    params = run.server_state.global_params
    trained = select(params, spec.trained)[0]
    expected = {p: np.shape(x) for p, x in flatten_paths(trained).items()}
    dtypes = codec.sent_dtypes(trained)
    dp = spec.aggregator.dp is not None
    taken = Taken(norms=[] if dp else None)
    for cid in sorted(replies):
        reply = replies[cid]
        try:
            upload, nbytes = _decode_upload(reply, expected, spec.wire_dtype, dtypes)
            examples, loss, spent = reply_figures(run, cid, reply, expect)
            norm = _number(reply.content[protocol.METRICS], protocol.UPDATE_NORM,
                           "update norm") if dp else None  # fmt: skip
        except ValueError as err:
            rejected[cid] = f"bad upload: {err}"
            continue
        taken.add(cid, examples, loss, spent, nbytes, upload)
        if norm is not None:
            taken.norms.append(norm)
    return taken


def reply_figures(
    run: ServerRun, cid: int, reply: Any, expect: tuple[str, ...]
) -> tuple[int, float, dict[str, int]]:
    """A TRAIN reply's figures, checked (ValueError): (its example count, the one the node
    reported when it joined; its mean loss as the simulation computes it; its FLOP counts)."""
    if protocol.METRICS not in reply.content.metric_records:
        raise ValueError("no training metrics")
    m = reply.content[protocol.METRICS]
    examples = _number(m, protocol.NUM_TRAIN, "example count", integral=True)
    if examples != len(run.partition.clients[cid].train):
        raise ValueError(
            f"example count {examples:g}, but the node reported "
            f"{len(run.partition.clients[cid].train)} training examples when it joined"
        )
    loss_sum = _number(m, protocol.LOSS_SUM, "loss sum")
    units = _number(m, protocol.LOSS_UNITS, "loss count")
    # the simulation's loss_sum / max(num_examples, 1), in fp32
    loss = np.float32(loss_sum) / np.maximum(np.float32(units), np.float32(1.0))
    return int(examples), float(loss), {k: whole_count(m, protocol.COSTS[k]) for k in expect}


@dataclasses.dataclass
class Ahead:
    """Round r's training, sent in round r-1's evaluation exchange (`evaluate`): its plan, the
    global part sent, the replies and failures, and the exchange's seconds, which count as round
    r's training (not as round r-1's evaluation). Held in memory only: a run stopped or killed
    before round r starts trains round r again on resume, as if it had never been sent."""

    plan: RoundPlan
    sent: Mapping[str, np.ndarray]
    replies: dict[int, Any]
    failed: dict[int, str]
    seconds: float
    secure: tuple[secagg.Params, FixedPoint] | None = None  # a secure round's settings, sent


def run_round(
    run: ServerRun, exchange: Exchange, r: int, history: list[dict[str, Any]],
    options: DeployOptions, keep_from: int, ahead: Ahead | None = None,
) -> tuple[dict[str, Any], Ahead | None]:  # fmt: skip
    """Round r over the federation: (the round's record, metrics.jsonl's row; round r+1's
    training where its exchange carried round r's evaluation). `keep_from`: the oldest kept
    checkpoint's round (the nodes keep the local parts it and later ones need). `ahead`: round
    r's training, already exchanged with round r-1's evaluation. The strategy decides
    (`fed.strategy`: the clients, the spec, the clip, the server's step, the record); this moves
    the arrays."""
    t0 = time.perf_counter()
    if ahead is not None and ahead.plan.round == r:
        plan, sent, replies, failed = ahead.plan, ahead.sent, ahead.replies, ahead.failed
        secure = ahead.secure
        t0 -= ahead.seconds
    else:
        plan = run.strategy.plan(r, run.server_state, run.secret)  # DP, M < K: maybe nobody
        sent = codec.encode(run.server_state.global_params, run.model.round_spec.wire_dtype)
        msgs = _train_messages(run, plan, sent, keep_from)
        secure = _secure_settings(run, plan, msgs)
        replies, failed = exchange.send(msgs, options.round_timeout) if msgs else ({}, {})
    rejected: dict[int, str] = {}
    expect = expected_costs(run, plan.spec)
    outcome = (replies, failed, rejected)
    if secure is None:
        taken, valid, agg_norms = _plain_step(run, plan, outcome, expect)
    else:  # the server sees the sum alone
        taken, valid, agg_norms = _secure_step(run, exchange, plan, secure, outcome, expect)
    weights = np.asarray(taken.weights, np.float32)
    jax.block_until_ready(run.server_state)
    t_train = time.perf_counter()
    record = run.strategy.record(plan, np.asarray(taken.losses, np.float64), weights,
                                 *taken.answered(rejected, valid, agg_norms))  # fmt: skip
    eval_failed: dict[int, str] = {}
    eval_bytes, next_ahead = 0, None
    if driver.due(r, run.config.outputs.eval_every, run.rounds):
        done = [c for c in plan.clients if int(c) not in failed]
        trained = pieces.trained_clients(history, done)
        evaluated, eval_failed, eval_bytes, next_ahead = evaluate(
            run, exchange, r, options, failed, trained, keep_from
        )
        record.update(evaluated)
    t_end = time.perf_counter() - (0.0 if next_ahead is None else next_ahead.seconds)
    times, num = (t0, t_train, max(t_end, t_train)), len(plan.clients)
    record.update(pieces.cost_record(
        history, taken.bytes_up, codec.nbytes(sent) * num, times, taken.costs, bool(expect),
        run.bert_fl_bytes, num,
    ))  # fmt: skip
    record.update(clients_failed=sorted(failed), eval_failed=sorted(eval_failed),
                  eval_bytes_down=eval_bytes)  # fmt: skip
    if taken.secagg_bytes is not None:
        record["secagg_bytes_up"] = taken.secagg_bytes
    return record, next_ahead


Stepped = tuple[Taken, Any, Any]  # the uploads taken; accepted and update norms, each [taken]


def _plain_step(
    run: ServerRun, plan: RoundPlan,
    outcome: tuple[dict[int, Any], dict[int, str], dict[int, str]], expect: tuple[str, ...],
) -> Stepped:  # fmt: skip
    """A round after its TRAIN replies (`outcome`: replies, failed, rejected; the last filled in
    here): the valid uploads taken, then the strategy's server step over them."""
    replies, failed, rejected = outcome
    taken = _take_uploads(run, plan.spec, replies, rejected, expect)
    _check_replies(plan.round, plan.clients, replies, failed, rejected)
    weights = np.asarray(taken.weights, np.float32)
    norms = None if taken.norms is None else np.asarray(taken.norms, np.float32)
    run.server_state, valid, agg_norms = run.strategy.aggregate(
        plan, run.server_state, taken.uploads, weights, norms)  # fmt: skip
    return taken, valid, agg_norms


def _secure_settings(
    run: ServerRun, plan: RoundPlan, msgs: Mapping[int, Any]
) -> tuple[secagg.Params, FixedPoint] | None:
    """A secure round's SecAgg+ settings and quantisation, added to each TRAIN message (None,
    nothing added, for a round without secure aggregation or without clients)."""
    if not (plan.spec.aggregator.secure and msgs):
        return None
    sizes = {c: len(run.partition.clients[c].train) for c in plan.clients.tolist()}
    entries = param_count(select(run.server_state.global_params, plan.spec.trained)[0])
    params, fixed = secure_round.round_settings(plan, run.strategy.fixed_point, sizes, entries)
    for msg in msgs.values():
        msg.content[protocol.SECAGG] = _config_record(secure_node.settings(params, fixed))
    return params, fixed


def _secure_step(
    run: ServerRun, exchange: Exchange, plan: RoundPlan,
    settings: tuple[secagg.Params, FixedPoint],
    outcome: tuple[dict[int, Any], dict[int, str], dict[int, str]], expect: tuple[str, ...],
) -> Stepped:  # fmt: skip
    """A secure round after its TRAIN replies (`outcome`: replies, failed, rejected; the last two
    filled in here): SecAgg+'s stages (`deploy.secure_round`), then the server's step from the
    survivors' sum. The survivors' figures, taken (each accepted; no norm is seen)."""
    replies, failed, rejected = outcome
    figures: dict[int, tuple[int, float, dict[str, int]]] = {}
    adverts = []
    for cid in sorted(replies):
        try:
            figured = reply_figures(run, cid, replies[cid], expect)
            adverts.append(secure_round.advert_of(replies[cid], cid))
        except ValueError as err:
            rejected[cid] = f"bad reply: {err}"
            continue
        figures[cid] = figured
    cfg = {protocol.RUN: run.run_id, protocol.ROUND: plan.round}
    params, fixed = settings
    result = secure_round.secure_sum(exchange.send, run.nodes, cfg, params, adverts,
                                     exchange.options.round_timeout)  # fmt: skip
    failed.update(result.failed)
    rejected.update(result.refused)
    taken = Taken(bytes_up=result.masked_bytes, secagg_bytes=result.key_bytes)
    for cid, (examples, loss, spent) in figures.items():
        if cid in result.survivors:
            taken.add(cid, examples, loss, spent, 0)
    _check_replies(plan.round, plan.clients, replies, failed, rejected)
    run.server_state = run.strategy.aggregate_sum(plan, run.server_state, result.total, fixed)
    num = len(taken.clients)
    return taken, np.ones(num, bool), np.zeros(num, np.float32)


def _check_replies(
    r: int, sampled: np.ndarray, replies: Mapping[int, Any], failed: Mapping[int, str],
    rejected: Mapping[int, str],
) -> None:  # fmt: skip
    """Warns of each failed client and rejected upload; a round in which clients were sampled
    and none replied stops the run (its last checkpoint stays)."""
    for cid, why in sorted(failed.items()):
        _warn(f"round {r}: client {cid} failed ({why})")
    for cid, why in sorted(rejected.items()):
        _warn(f"round {r}: client {cid}'s upload rejected ({why})")
    if len(sampled) and not replies:
        raise UserError(
            f"round {r}: no sampled client replied ({'; '.join(sorted(set(failed.values())))}); "
            "check the SuperNodes, then continue with --resume"
        )


def metric_names(task: Any, tag_names: Sequence[str] = ()) -> frozenset[str]:
    """Every metric name the task's scoring (`run.pieces.score`) can give a client: the task's
    metrics, MNLI's per group, a token task's `f1_<type>` of each entity type of its tags."""
    names = set(task.metrics)
    names.update(f"{m}_{g}" for m in task.metrics for g in task.groups)
    if task.objective.per_token:
        names.update(f"f1_{t[2:]}" for t in tag_names if t[:2] in ("B-", "I-"))
    return frozenset(names)


def eval_metrics(reply: Any, cid: int, names: frozenset[str], task: Any,
                 key: str = protocol.EVAL_JSON) -> dict[str, float]:  # fmt: skip
    """A client's evaluate reply's metrics (under `key`: its own model's, or the global model's),
    or ValueError: the reply is untrusted (one bad value would crash the server or skew the mean,
    a "client" key would claim another's row), so it must be the client's own JSON object of the
    task's metrics, each a real number or NaN (a metric undefined on its split); {} where it has
    no test examples."""
    if protocol.CONFIG not in reply.content.config_records:
        raise ValueError("no config record")
    cfg = reply.content[protocol.CONFIG]
    if cfg.get(protocol.CLIENT) != cid:
        raise ValueError(f"answered as client {cfg.get(protocol.CLIENT)!r}")
    text = cfg.get(key)
    if not isinstance(text, str) or len(text) > 64 * (len(names) + 1) + sum(map(len, names)):
        raise ValueError(f"{key} is not a JSON text of at most {len(names)} metrics")
    try:
        metrics = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"metrics are not JSON ({str(err)[:60]})") from None
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics are a {type(metrics).__name__}, not an object")
    unknown = sorted(set(metrics) - names)
    if unknown or (metrics and not set(task.metrics) <= set(metrics)):
        bad = unknown or sorted(set(task.metrics) - set(metrics))
        raise ValueError(f"metrics {bad[:3]} are not the task's {sorted(task.metrics)}")
    for name, value in metrics.items():
        if type(value) not in (int, float) or np.isinf(value):
            raise ValueError(f"metric {name} {str(value)[:40]!r} is not a real number")
    return {k: float(v) for k, v in metrics.items()}


def evaluate(
    run: ServerRun,
    exchange: Exchange,
    r: int,
    options: DeployOptions,
    skip: Mapping[int, str],
    trained: set[int],
    keep_from: int = 0,
) -> tuple[dict[str, Any], dict[int, str], int, Ahead | None]:
    """Every client (but those that just failed) scores the new global part with its own local
    part on its own test split: (metrics as the simulation records them, failures, bytes sent for
    evaluation alone, round r+1's training). `trained`: the clients whose uploads the server has
    taken so far (for `trained_mean`). Before the last round, round r+1's train messages go in
    the same exchange, each carrying its client's evaluation (`protocol.EVAL_ROUND`: the global
    part round r+1 sends is the one evaluated), and only the clients not sampled in round r+1 get
    an evaluate message; one exchange instead of two. At a split run's last evaluation each
    client also scores the global model (the global part with the initial local part,
    `run.experiment.global_figures`): the personalisation gain. The simulation's `pooled` figure
    needs every client's predictions; only metrics leave a node, so it is not recorded here."""
    state = run.server_state
    wire = run.model.round_spec.wire_dtype
    sent = codec.encode(state.global_params, wire)
    cfg = {protocol.ROUND: r, protocol.WIRE: wire, protocol.RUN: run.run_id}
    both = r == run.rounds and run.model.num_local > 0
    if both:
        cfg[protocol.GLOBAL_EVAL] = True
    due = [cid for cid in range(run.config.federation.clients) if cid not in skip]
    fold = r < run.rounds and options.carry_evaluation  # (then never `both`: not the last)
    plan = run.strategy.plan(r + 1, state, run.secret) if fold else None
    carry = {cid: {protocol.EVAL_ROUND: r} for cid in due}
    train = {} if plan is None else _train_messages(run, plan, sent, keep_from, carry)
    secure = None if plan is None else _secure_settings(run, plan, train)
    msgs = {**train}
    for cid in (c for c in due if c not in train):
        content = {protocol.CONFIG: _config_record({**cfg, protocol.CLIENT: cid})}
        if sent:
            content[protocol.GLOBAL] = codec.to_record(sent)
        msgs[cid] = _message(content, run.nodes[cid], protocol.EVALUATE)
    t0 = time.perf_counter()
    replies, failed = exchange.send(msgs, options.round_timeout) if msgs else ({}, {})
    carried = None if plan is None else Ahead(
        plan, sent, {c: m for c, m in replies.items() if c in train},
        {c: why for c, why in failed.items() if c in train}, time.perf_counter() - t0,
        secure)  # fmt: skip
    got = {c: replies[c] for c in due if c in replies}
    lost = {c: failed[c] for c in due if c in failed}
    record, lost = _evaluated(run, r, got, lost, skip, trained, both)
    return record, lost, codec.nbytes(sent) * (len(msgs) - len(train)), carried


def _evaluated(
    run: ServerRun, r: int, replies: Mapping[int, Any], failed: dict[int, str],
    skip: Mapping[int, str], trained: set[int], both: bool,
) -> tuple[dict[str, Any], dict[int, str]]:  # fmt: skip
    """The evaluation's record from the clients' replies (evaluate replies, or train replies that
    carried it) and every client that failed to evaluate (`skip`: those that failed to train)."""
    failed.update({cid: why for cid, why in skip.items()})
    per_client, theirs = [], []
    names = metric_names(run.model.task, run.tag_names)
    keys = (protocol.EVAL_JSON, protocol.GLOBAL_EVAL_JSON) if both else (protocol.EVAL_JSON,)
    for cid in sorted(replies):
        try:
            metrics = [eval_metrics(replies[cid], cid, names, run.model.task, k) for k in keys]
        except ValueError as err:
            failed[cid] = f"bad evaluation: {err}"
            continue
        own, *initial = metrics
        if own:
            per_client.append({"client": cid, **own})
        if initial and initial[0]:
            theirs.append({"client": cid, **initial[0]})
    for cid, why in sorted(failed.items()):
        if cid not in skip:
            _warn(f"round {r}: client {cid} failed to evaluate ({why})")
    return pieces.personalised_record(per_client, trained, theirs if both else None), failed


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
        pieces.check_partition(meta, self.run.partition, "the nodes' data")
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
        note(pieces.method_line(config, model))
        for line in safeguards.start_lines(config, self.rounds):
            note(line)
        note(
            f"{config.data.task} on Flower: {config.federation.clients} SuperNodes, "
            f"{model.num_global:,} global / {model.num_local:,} local parameters per client"
            + (f"; resuming after round {start_round}" if start_round else "")
        )

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
    outputs = config.outputs
    pieces.check(config)
    safeguards.check_deployable(config)
    driver.check_run_dir(config.run_dir, outputs.resume,
                         lambda saved: trajectory_mismatch(saved, config))  # fmt: skip
    run = build_server(config, connect(grid, config, options))

    def stop(round_: int, record: dict[str, Any]) -> None:
        if options.stop_after_round == round_:
            raise Stopped(round_)

    return driver.drive(
        FlowerServer(run, Exchange(grid, options), options),
        saved_dict(config),
        resume=outputs.resume,
        checkpoint_every=outputs.checkpoint_every,
        keep_checkpoints=outputs.keep_checkpoints,
        progress=progress,
        on_round_end=stop,
    )

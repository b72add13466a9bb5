"""What the SuperNodes report when they join, and the server's side of the run built from it.

`connect` asks every SuperNode who it is (the query) and maps each client id to its node. A
query reply is untrusted: the clients it names, each one's share of the data (train and test
indices and the pool's size and settings, `partition_from_nodes`; a site: indices into its own
rows and its row count), the realised label shares and the tag vocabulary are checked, and a
reply the server cannot use stops the run before round 1 with one line naming the SuperNode.
`build_server` makes the server's side of the run from them (`ServerRun`: the model, its roles
and the server state, as `run.pieces` makes them for every node, without data).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_split.data.partition import SITES, ClientSplit, Partition, sites_partition
from fedjax_split.data.tokens.tagged import NO_ENTITY
from fedjax_split.deploy import protocol
from fedjax_split.deploy.messaging import DeployOptions, Exchange, new_message
from fedjax_split.errors import UserError
from fedjax_split.fed.aggregation import init_state
from fedjax_split.fed.secret import ServerSecret
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import Strategy
from fedjax_split.run import client_data, costs, pieces, safeguards
from fedjax_split.run.config import ExperimentConfig
from fedjax_split.tasks import registry as tasks


def connect(
    grid: Any, config: ExperimentConfig, options: DeployOptions, query: str = protocol.QUERY
) -> dict[int, Any]:
    """Waits for the SuperNodes and asks each who it is: {client id: (node id, query reply)}.

    Every client id 0..K-1 must answer exactly once within `connect_timeout`, else UserError.
    `query`: the message type that asks (further pre-training's is "query.pretrain")."""
    federation = config.federation
    exchange = Exchange(grid, options)
    deadline = time.monotonic() + options.connect_timeout
    found: dict[int, tuple[int, Any]] = {}
    asked: set[int] = set()
    last_failures: dict[int, str] = {}
    while True:
        nodes = [n for n in grid.get_node_ids() if n not in asked]
        if nodes:
            asked.update(nodes)
            msgs = {n: new_message({}, n, query) for n in nodes}
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
        missing = sorted(set(range(federation.clients)) - set(found))
        if not missing:
            break
        if time.monotonic() >= deadline:
            why = f" ({next(iter(last_failures.values()))})" if last_failures else ""
            raise UserError(
                f"clients {missing} did not connect within {options.connect_timeout:g} s{why}; "
                f"start SuperNodes that hold them, with --node-config 'partition-id=<0..."
                f"{federation.clients - 1}>' or 'partition-ids=A-B'"
            )
        time.sleep(options.poll_interval)
    extra = sorted(set(found) - set(range(federation.clients)))
    if extra:
        raise UserError(f"SuperNodes with partition-id {extra} but --clients {federation.clients}")
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
    federation = config.federation
    metas = {json.dumps(_partition_meta(node_id, cfg), sort_keys=True)
             for node_id, cfg in found.values()}  # fmt: skip
    if len(metas) != 1:
        raise UserError("the SuperNodes partition the data differently; give them the same data")
    meta = json.loads(metas.pop())
    sizes = []
    for i in range(federation.clients):
        node_id, cfg = found[i]
        size = _whole(cfg.get(protocol.POOL_SIZE))
        if size is None or size < 0:
            raise _bad_reply(node_id, f"client {i}'s pool size {cfg.get(protocol.POOL_SIZE)!r}")
        sizes.append(size)
    sites = meta["scheme"] == SITES
    if not sites and len(set(sizes)) > 1:
        raise UserError(f"the SuperNodes report pools of {sorted(set(sizes))} examples; give "
                        "them the same data")  # fmt: skip
    clients = [_client_split(found[i][0], i, found[i][1], sizes[i])
               for i in range(federation.clients)]  # fmt: skip
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
    """A token task's tag vocabulary: the run config's (`configured`, client_data.tag_names), which
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
        types = client_data.entity_types(config, task)
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
    tag_names = _tag_names(found, client_data.tag_names(config, task))
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

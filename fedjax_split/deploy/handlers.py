"""What a node does with each message of the ClientApp (`deploy.client_app`): build its clients
(`deploy.node`, `deploy.pretrain_node`), check what came, train or evaluate, and reply. The node's
warm worker (`deploy.worker`) runs these, keeping the node's clients (data share, model, compiled
programs) in memory between messages; the ClientApp process runs them itself only when the node
config turns the worker off. Each handler reads the client's local part from the node's disk
(`node.store`, under the node config's `state-dir`). The reply carries only the trained global
part, in the wire dtype as bits (`codec`), and scalar metrics: the local part never enters a
message.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedjax_split import runtime
from fedjax_split.assets import cache_dir
from fedjax_split.deploy import codec, logs, pretrain_node, protocol, secure_node
from fedjax_split.deploy import node as node_mod
from fedjax_split.deploy.node import NodeSetup, local_part, node_clients
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import select, unflatten_paths
from fedjax_split.fed.wire import wire_dtype
from fedjax_split.run.config import resolve_config
from fedjax_split.run.pretrain_config import resolve
from fedjax_split.run.sites import NODE_SITES
from fedjax_split.sim.client_store import ClientStore

_PREPARED: dict[str, Any] = {}  # a warm worker's clients, by what they were built from
_KEEP_PREPARED = 2  # a run's clients (a later run's replace them: models hold memory)


def _nodes(context: Context) -> dict[int, NodeSetup]:
    """This node's clients (`node.node_clients`), in a process whose settings are applied first
    (`logs.app_process`, `runtime.apply`). A warm worker keeps the few it built last: the same
    run config and node config give the same clients."""
    logs.app_process()
    runtime.apply()
    values = protocol.experiment_values(context.run_config)
    data_dir = context.node_config.get(protocol.DATA_DIR)
    data_dir = str(data_dir) if data_dir else None
    sites = values.get("site_data") is not None  # then data-dir is this site's own data
    if data_dir and not sites:
        values["data_dir"] = data_dir
    clients = node_mod.node_clients(context.node_config)
    key = json.dumps([values, clients, data_dir, str(_state_dir(context))], sort_keys=True)
    return _prepared(key, lambda: node_mod.prepare_many(
        resolve_config(overrides=values), clients, _state_dir(context) / "tokenized",
        site_dir=data_dir if sites else None))  # fmt: skip


def _prepared(key: str, build: Callable[[], Any]) -> Any:
    """`build()`, or what it built for the same `key` before: a warm worker keeps the last
    `_KEEP_PREPARED` (a ClientApp process without a worker builds once and ends)."""
    if key not in _PREPARED:
        while len(_PREPARED) >= _KEEP_PREPARED:
            _PREPARED.pop(next(iter(_PREPARED)))
        _PREPARED[key] = build()
    return _PREPARED[key]


def _node(context: Context, msg: Message) -> NodeSetup:
    """The client of this node that `msg` is for (its config's client id)."""
    nodes = _nodes(context)
    client = int(msg.content[protocol.CONFIG][protocol.CLIENT])
    if client not in nodes:
        raise ValueError(f"message for client {client} reached {','.join(map(str, nodes))}")
    return nodes[client]


def _state_dir(context: Context) -> Path:
    return Path(str(context.node_config.get(protocol.STATE_DIR) or cache_dir() / "flower_nodes"))


def _store(context: Context, run_id: str, node: NodeSetup) -> ClientStore:
    return node_mod.store(_state_dir(context), run_id, node)


def _reply(msg: Message, content: RecordDict) -> Message:
    return protocol.record_sent(Message(content, reply_to=msg), "client")


def _received(msg: Message, node: NodeSetup) -> tuple[Any, Any]:
    """(the global part in the wire dtype, the message's config), checked against the model."""
    cfg = msg.content[protocol.CONFIG]
    wire = wire_dtype(node.round_spec.wire_dtype)
    if str(cfg[protocol.WIRE]) != wire.name:
        raise ValueError(f"the message says wire dtype {cfg[protocol.WIRE]}; this run's is "
                         f"{wire.name}")  # fmt: skip
    sent_as = np.dtype(np.uint16) if wire.itemsize == 2 else np.dtype(wire)  # 16-bit as bits
    arrays = codec.from_record(msg.content[protocol.GLOBAL]) if node.global_shapes else {}
    codec.check_like(arrays, node.global_shapes, "received global part",
                     dict.fromkeys(node.global_shapes, sent_as))  # fmt: skip
    if not arrays:
        return unflatten_paths({}), cfg
    return codec.decode(arrays, wire.name), cfg


def _query(msg: Message, context: Context) -> Message:
    """Who this node is: its clients, and for each its share of the pool (indices and sizes
    only; a site with its own data: indices into its own rows, their count and its label
    shares)."""
    nodes = _nodes(context)
    records = {protocol.CONFIG: ConfigRecord({protocol.CLIENTS: list(nodes)})}
    for cid, node in nodes.items():
        tags = list(getattr(node.pool.examples, "tag_names", ()) or ())
        content = {
            protocol.CLIENT: cid,
            protocol.SPLIT_TRAIN: [int(i) for i in node.split.train],
            protocol.SPLIT_TEST: [int(i) for i in node.split.test],
            protocol.SHARES: json.dumps(node.shares),
            protocol.POOL_SIZE: node.pool_size,
            protocol.PARTITION: json.dumps(node.partition_meta),
        }
        if tags:
            content[protocol.TAG_NAMES] = tags
        records[protocol.client_record(cid)] = ConfigRecord(content)
    return _reply(msg, RecordDict(records))


def _train(msg: Message, context: Context) -> Message:
    """One round of local training; the new local part goes to the node's disk, the trained global
    part (wire dtype, as bits) into the reply. A message that carries the previous round's
    evaluation (`protocol.EVAL_ROUND`) is first answered as `_evaluate` would answer it: the
    same global part, the same local part, the metrics in the same reply."""
    node = _node(context, msg)
    global_wire, cfg = _received(msg, node)
    run_id, r = str(cfg[protocol.RUN]), int(cfg[protocol.ROUND])
    state_round = int(cfg[protocol.STATE_ROUND])
    scores = _carried_evaluation(node, _store(context, run_id, node), global_wire, cfg, r)
    trained = frozenset(str(p) for p in cfg[protocol.TRAINED]) if protocol.TRAINED in cfg else None
    if trained is not None:
        unknown = sorted(trained - set(node.global_shapes))[:3]
        if unknown or not trained:
            raise ValueError(f"the server asked to train {unknown or 'nothing'}: not this "
                             "node's global parameters; refusing to train")  # fmt: skip
        node = dataclasses.replace(
            node, round_spec=dataclasses.replace(node.round_spec, trained=trained)
        )
    store = _store(context, run_id, node)
    local = local_part(node, store, r - 1)
    keep_from = int(cfg[protocol.KEEP_FROM])
    if keep_from and store.version(node.client_id, r - 1) is None:
        node_mod.keep_initial(store, node)  # a kept checkpoint predates its first training
    clip = float(cfg[protocol.DP_CLIP]) if protocol.DP_CLIP in cfg else None
    upload, new_local, metrics, norm, spent = node_mod.train(node, global_wire, r, state_round,
                                                             local, clip)  # fmt: skip
    store.save_one(r, node.client_id, new_local)
    store.prune(keep_from)
    wire = str(cfg[protocol.WIRE])
    sent = codec.encode(select(upload, trained)[0], wire)
    reported = {
        protocol.LOSS_SUM: float(metrics.loss_sum),
        protocol.LOSS_UNITS: float(metrics.num_examples),
        protocol.STEPS: int(metrics.num_steps),
        protocol.NUM_TRAIN: len(node.split.train),
    }
    secure = protocol.SECAGG in msg.content.config_records
    if norm is not None and not secure:  # DP: the norm before clipping (adaptive clipping)
        reported[protocol.UPDATE_NORM] = norm
    for name, value in spent.items():  # run.costs: the steps' matmul FLOPs (and BERT-FL's)
        reported[protocol.COSTS[name]] = value
    content = RecordDict(
        {
            protocol.CONFIG: ConfigRecord(
                {protocol.CLIENT: node.client_id, protocol.WIRE: wire, **scores}
            ),
            protocol.METRICS: MetricRecord(reported),
        }
    )
    if secure:  # the upload stays here: its fixed-point vector goes out masked, later
        advert = secure_node.start(node, msg.content[protocol.SECAGG], run_id, upload, global_wire,
                                   trained, clip, norm)  # fmt: skip
        content[protocol.SECAGG] = ConfigRecord(advert)
    elif sent:
        content[protocol.UPLOAD] = codec.to_record(sent)
    return _reply(msg, content)


def _secagg(kind: str) -> Callable[[Message, Context], Message]:
    """The handler of secure aggregation's stage `kind` (`deploy.secure_node`)."""

    def handle(msg: Message, context: Context) -> Message:
        cfg = msg.content[protocol.CONFIG]
        here = f"{int(cfg[protocol.ROUND])}:{kind}:{int(cfg[protocol.CLIENT])}"
        if here in os.environ.get(protocol.SECAGG_DROP_ENV, "").split(","):
            os._exit(3)  # tests: this site dies here, its keys with it
        out = secure_node.stage(kind, cfg, dict(msg.content[protocol.SECAGG]))
        masked = out.pop("masked", None)
        who = ConfigRecord({protocol.CLIENT: cfg[protocol.CLIENT]})
        content = RecordDict({protocol.CONFIG: who, protocol.SECAGG: ConfigRecord(out)})
        if masked is not None:
            content[protocol.MASKED] = codec.to_record({protocol.MASKED: masked})
        return _reply(msg, content)

    return handle


def _evaluate(msg: Message, context: Context) -> Message:
    """This client's metrics on its own test split, with its local part after the round (and when
    asked, the global model's: the initial local part in its place)."""
    node = _node(context, msg)
    global_wire, cfg = _received(msg, node)
    store = _store(context, str(cfg[protocol.RUN]), node)
    content = {protocol.CLIENT: node.client_id,
               **_scores(node, store, global_wire, int(cfg[protocol.ROUND]),
                         bool(cfg.get(protocol.GLOBAL_EVAL)))}  # fmt: skip
    return _reply(msg, RecordDict({protocol.CONFIG: ConfigRecord(content)}))


def _scores(
    node: NodeSetup, store: ClientStore, global_wire: Any, r: int, global_eval: bool
) -> dict[str, str]:
    """The evaluate reply's metrics (JSON) of the client's model after round r: the global part
    received with its local part after round r (kept for the export at the site), and with
    `global_eval` the global model's (the initial local part in place of ours)."""
    local = local_part(node, store, r)
    node_mod.keep_for_export(store, node, global_wire, r, local)
    scores = {protocol.EVAL_JSON: json.dumps(node_mod.evaluate(node, global_wire, local))}
    if global_eval:
        initial = node_mod.evaluate(node, global_wire, node.local0)
        scores[protocol.GLOBAL_EVAL_JSON] = json.dumps(initial)
    return scores


def _carried_evaluation(
    node: NodeSetup, store: ClientStore, global_wire: Any, cfg: Any, r: int
) -> dict[str, str]:
    """`_scores` of the evaluation a train message of round r carries (that of round r - 1, whose
    server state is the global part received), before the client trains; {} where none."""
    if protocol.EVAL_ROUND not in cfg:
        return {}
    after = int(cfg[protocol.EVAL_ROUND])
    if after != r - 1:
        raise ValueError(f"a train message of round {r} asked to evaluate after round {after}; "
                         f"only round {r - 1}'s state is in it")  # fmt: skip
    return _scores(node, store, global_wire, after, bool(cfg.get(protocol.GLOBAL_EVAL)))


# Further pre-training ("query.pretrain", "train.pretrain", "evaluate.pretrain": the run config's
# kind is "pretrain"): `deploy.pretrain_node` does the work; clients keep nothing between rounds.


def _pretrain_node(context: Context) -> pretrain_node.PretrainNode:
    """This node's further pre-training client, in a process whose settings are applied first;
    the node config's data-dir overrides the run's --data-dir, or in a --site-data run is this
    site's own text, the only text it reads (the run config says `node-config`, whatever paths
    an App's author left in it)."""
    logs.app_process()
    runtime.apply()
    values = json.loads(str(context.run_config[protocol.PRETRAIN_CONFIG]))
    data_dir = context.node_config.get(protocol.DATA_DIR)
    data_dir = str(data_dir) if data_dir else None
    sites = values.get("site_data") is not None
    if sites:
        values["site_data"] = NODE_SITES
    elif data_dir:
        values["data_dir"] = data_dir
    ids = node_clients(context.node_config)
    if len(ids) != 1:
        raise UserError("further pre-training runs one client per SuperNode: give it one "
                        "partition-id")  # fmt: skip
    key = json.dumps(["pretrain", values, ids[0], data_dir], sort_keys=True)
    return _prepared(key, lambda: pretrain_node.prepare(
        resolve(overrides=values), ids[0], data_dir if sites else None))  # fmt: skip


def _pretrain_received(
    msg: Message, node: pretrain_node.PretrainNode, layers: Iterable[int]
) -> Any:
    """The model the message carries (global layers `layers`, the embeddings and the head under
    their global paths, fp32), checked against this node's model and decoded."""
    if int(msg.content[protocol.CONFIG][protocol.CLIENT]) != node.client_id:
        raise ValueError(f"message for client {msg.content[protocol.CONFIG][protocol.CLIENT]} "
                         f"reached {node.client_id}")  # fmt: skip
    arrays = codec.from_record(msg.content[protocol.GLOBAL])
    expected = pretrain_node.expected_shapes(node, layers)
    codec.check_like(arrays, expected, "received model", {p: np.dtype("float32") for p in expected})
    return codec.decode(arrays, node.trainer.wire_dtype)


def _pretrain_query(msg: Message, context: Context) -> Message:
    """Who this node is: its client id, its training sequences, the split it derives (a site:
    its counts), its held-out batches."""
    node = _pretrain_node(context)
    content = {
        protocol.CLIENT: node.client_id,
        protocol.SEQUENCES: pretrain_node.num_sequences(node),
        protocol.SPLIT_JSON: json.dumps(node.split),
        protocol.HELDOUT_BATCHES: len(node.heldout),
    }
    return _reply(msg, RecordDict({protocol.CONFIG: ConfigRecord(content)}))


def _pretrain_train(msg: Message, context: Context) -> Message:
    """One round of this client: its model as the round's plan says, its own MLM batches; the
    reply carries the trained part only and the client's figures."""
    node = _pretrain_node(context)
    cfg = msg.content[protocol.CONFIG]
    layers = [int(g) for g in cfg[protocol.LAYERS]]
    pretrain_node.check_layers(node, layers)
    received = _pretrain_received(msg, node, layers)
    trained = frozenset(str(p) for p in cfg[protocol.TRAINED])
    upload, report, bert_fl = pretrain_node.train(node, received, int(cfg[protocol.ROUND]),
                                                  layers, trained)  # fmt: skip
    metrics = {
        protocol.TRAIN_LOSS: report.loss, protocol.TOKENS: report.tokens,
        protocol.STEPS: report.steps, protocol.FLOPS: report.flops,
        protocol.BERT_FL_FLOPS: bert_fl, protocol.SECONDS: report.seconds,
        protocol.CPU_SECONDS: report.cpu_seconds,
        protocol.SEQUENCES: pretrain_node.num_sequences(node),
    }  # fmt: skip
    content = RecordDict({
        protocol.CONFIG: ConfigRecord({protocol.CLIENT: node.client_id}),
        protocol.METRICS: MetricRecord(metrics),
        protocol.UPLOAD: codec.to_record(codec.encode(upload, node.trainer.wire_dtype)),
    })  # fmt: skip
    return _reply(msg, content)


def _pretrain_evaluate(msg: Message, context: Context) -> Message:
    """This node's share of the held-out batches scored with the model received: per batch, its
    index and [loss sum, predicted tokens, correct predictions]."""
    node = _pretrain_node(context)
    cfg = msg.content[protocol.CONFIG]
    depth = int(cfg[protocol.DEPTH])
    pretrain_node.check_layers(node, [depth], depth_only=True)
    params = _pretrain_received(msg, node, range(depth))
    index, sums = pretrain_node.evaluate(node, params, depth, int(cfg[protocol.PART]),
                                         int(cfg[protocol.PARTS]))  # fmt: skip
    content = RecordDict({
        protocol.CONFIG: ConfigRecord({protocol.CLIENT: node.client_id}),
        protocol.HELDOUT: codec.to_record({"batches": index, "sums": sums}),
    })  # fmt: skip
    return _reply(msg, content)


HANDLERS = {
    protocol.QUERY: _query, protocol.TRAIN: _train, protocol.EVALUATE: _evaluate,
    f"{protocol.QUERY}.{protocol.PRETRAIN}": _pretrain_query,
    f"{protocol.TRAIN}.{protocol.PRETRAIN}": _pretrain_train,
    f"{protocol.EVALUATE}.{protocol.PRETRAIN}": _pretrain_evaluate,
    **{f"{protocol.QUERY}.{k}": _secagg(k) for k in protocol.SECAGG_STAGES},
}  # fmt: skip

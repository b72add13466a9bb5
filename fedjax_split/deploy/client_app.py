"""The Flower ClientApp: a SuperNode runs one client or several, named in its node config.

Flower starts a fresh ClientApp process for every message; that process hands the message to the
node's warm worker (`deploy.worker`), which runs its handler (`deploy.handlers`) and keeps the
node's client (data share, model, compiled programs) in memory between messages. This module
imports only Flower and the worker's client side, so that a message does not pay for importing
JAX in the process Flower starts.

Node config: `partition-id` (this client's id, 0..K-1) or `partition-ids` (several clients, e.g.
`0-33`: the node answers for each), `state-dir` (where local parts live;
default: `<cache>/flower_nodes`), `data-dir` (this node's copy of the task's files, overriding
the run's --data-dir; in a run with --site-data, this site's own files, the only data it reads),
`warm-worker` (default true; false runs each handler in its ClientApp process).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedjax_split import runtime
from fedjax_split.deploy import logs, protocol, worker

app = ClientApp()


def _here(kind: str) -> Callable[[Message, Context], Message]:
    """The handler of `kind`, run in this process when the node config turns the worker off."""

    def run(msg: Message, context: Context) -> Message:
        logs.app_process()
        runtime.apply()  # the process settings before the handlers' modules import JAX
        from fedjax_split.deploy import handlers

        return handlers.HANDLERS[kind](msg, context)

    return run


def _handle(kind: str, msg: Message, context: Context) -> Message:
    return worker.handle(kind, msg, context, _here(kind))


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _handle(protocol.QUERY, msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _handle(protocol.TRAIN, msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(protocol.EVALUATE, msg, context)


# Further pre-training ("query.pretrain", "train.pretrain", "evaluate.pretrain": the run config's
# kind is "pretrain") and secure aggregation's stages after TRAIN ("query.secagg_share", ...:
# `deploy.secure_node`), each a named action of its message kind.
ACTIONS = (
    *((kind, protocol.PRETRAIN) for kind in (protocol.QUERY, protocol.TRAIN, protocol.EVALUATE)),
    *((protocol.QUERY, stage) for stage in protocol.SECAGG_STAGES),
)


def _handler(kind: str) -> Callable[[Message, Context], Message]:
    def handle(msg: Message, context: Context) -> Message:
        return _handle(kind, msg, context)

    return handle


for _kind, _action in ACTIONS:
    getattr(app, _kind)(_action)(_handler(f"{_kind}.{_action}"))

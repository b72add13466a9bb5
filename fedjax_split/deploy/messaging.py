"""How the Flower server talks to the SuperNodes: how long it waits (`DeployOptions`), the exchange
of messages for replies over a Flower Grid, per client and with a timeout (`Exchange`), the
builders of a message and its config record, and the one-line warnings of a round.

Fine-tuning's server (`deploy.server` and the modules of its round) and further pre-training's
(`deploy.pretrain_server`) both send through these; nothing here knows what a message says.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping
from typing import Any

from fedjax_split.deploy import protocol


@dataclasses.dataclass(frozen=True)
class DeployOptions:
    """How the server waits: for the nodes to connect, for each round's replies."""

    round_timeout: float = 600.0  # seconds a round (or an evaluation) waits for replies
    connect_timeout: float = 300.0  # seconds to wait for all K SuperNodes at the start
    poll_interval: float = 0.2  # seconds between two pulls of replies
    stop_after_round: int | None = None  # tests: stop (as Ctrl-C would) after this round
    # round r's evaluation in round r+1's train messages (`deploy.evaluation.evaluate`); False:
    # an exchange each
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


def config_record(values: Mapping[str, Any]) -> Any:
    from flwr.app import ConfigRecord

    return ConfigRecord(dict(values))


def new_message(content: Mapping[str, Any], node_id: int, kind: str) -> Any:
    from flwr.app import Message, RecordDict

    return Message(RecordDict(dict(content)), dst_node_id=node_id, message_type=kind)


def warn_line(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)

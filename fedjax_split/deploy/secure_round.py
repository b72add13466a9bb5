"""The Flower server's side of a secure round (`--secure-aggregation`): SecAgg+ over four exchanges.

1. TRAIN, with the round's SecAgg+ settings (`deploy.secure_node.settings`): each sampled client
   trains, keeps its fixed-point vector and replies with its figures and its advertisement.
2. SHARE: the key table (`secagg_server.server_keys`) to the clients that advertised; each
   replies with its encrypted Shamir shares for the others.
3. MASK: each client that shared gets the ciphertexts addressed to it
   (`secagg_server.server_route`) and replies with its masked vector; the server adds each to one
   running sum.
4. UNMASK: the survivors reveal the shares that remove the masks (`secagg_server.server_unmask`).
The server then holds the sum of the survivors' vectors modulo 2^64, never one client's vector,
masked or not, beyond adding it. A client that fails or is refused at any stage counts as
dropped (listed in `clients_failed` or `clients_rejected`); the survivors' figures (losses,
example counts) make the round's record. Fewer survivors than the threshold: `secagg.RoundLost`,
one line, and the run stops after its last checkpoint (`--resume` runs the round again, with new
keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict

from fedjax_split.deploy import codec, protocol, secagg, secagg_server
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.strategy import RoundPlan


@dataclasses.dataclass
class SecureResult:
    """A secure round's outcome on the server: the sum, and what each client came to."""

    total: np.ndarray  # the survivors' vectors summed modulo 2^64
    survivors: tuple[int, ...]
    failed: dict[int, str]  # client -> why it dropped out (no reply, an error)
    refused: dict[int, str]  # client -> why its message was refused
    masked_bytes: int  # the survivors' masked vectors (the round's uploads)
    key_bytes: int  # the rest the clients sent for the sum: keys, shares


def threshold(nodes: int) -> int:
    """SecAgg+'s threshold: the fewest above half the nodes (`secagg.Params` needs t > n/2, so
    that no server can collect both shares of one node), which tolerates the most dropouts."""
    return nodes // 2 + 1


def round_settings(
    plan: RoundPlan, fixed_point: Callable[[RoundPlan, int], FixedPoint], sizes: Mapping[int, int],
    entries: int,
) -> tuple[secagg.Params, FixedPoint]:  # fmt: skip
    """The round's SecAgg+ parameters and quantisation (weights up to the sampled clients' largest
    example count)."""
    clients = [int(c) for c in plan.clients]
    fixed = fixed_point(plan, max(sizes[c] for c in clients))
    params = secagg.Params(plan.round, tuple(clients), threshold(len(clients)),
                           fixed.length(entries))  # fmt: skip
    return params, fixed


def _query(cfg: Mapping[str, Any], node_id: int, stage: str, payload: Mapping[str, Any]) -> Any:
    content = RecordDict({protocol.CONFIG: ConfigRecord(dict(cfg)),
                          protocol.SECAGG: ConfigRecord(dict(payload))})  # fmt: skip
    return Message(content, dst_node_id=node_id, message_type=f"{protocol.QUERY}.{stage}")


def _payload(reply: Any, cid: int) -> dict[str, Any]:
    """A stage reply's payload as `deploy.secagg` reads it (the masked vector under "masked");
    its "node" must be the client it came from."""
    if protocol.SECAGG not in reply.content.config_records:
        raise secagg.Refused(cid, "a reply without its secure-aggregation record")
    payload = dict(reply.content[protocol.SECAGG])
    if payload.get("node") != cid:
        raise secagg.Refused(cid, f"a reply that says it is from node {payload.get('node')!r}")
    if protocol.MASKED in reply.content.array_records:
        arrays = codec.from_record(reply.content[protocol.MASKED])
        payload["masked"] = arrays.get(protocol.MASKED)
    return payload


def payload_size(payload: Mapping[str, Any]) -> int:
    """The bytes a stage's payload carries besides a masked vector (byte strings; ints at 8)."""
    total = 0
    for name, value in payload.items():
        if name != "masked":  # the upload itself, counted as the round's bytes up
            items = value if isinstance(value, list) else [value]
            total += sum(len(x) if isinstance(x, bytes) else 8 for x in items)
    return total


class _Stages:
    """One secure round's exchanges after TRAIN, with what each client came to."""

    def __init__(self, send: Callable[..., Any], nodes: Mapping[int, int],
                 cfg: Mapping[str, Any], timeout: float) -> None:  # fmt: skip
        self.send, self.nodes, self.cfg, self.timeout = send, nodes, cfg, timeout
        self.failed: dict[int, str] = {}
        self.refused: dict[int, str] = {}
        self.bytes_up = 0

    def payloads(self, replies: Mapping[int, Any]) -> list[dict[str, Any]]:
        out = []
        for cid, reply in sorted(replies.items()):
            try:
                out.append(_payload(reply, cid))
            except secagg.Refused as error:
                self.refused.setdefault(cid, str(error))
                continue
            self.bytes_up += payload_size(out[-1])
        return out

    def exchange(self, stage: str, payloads: Mapping[int, Mapping[str, Any]]) -> list[dict]:
        msgs = {cid: _query({**self.cfg, protocol.CLIENT: cid}, self.nodes[cid], stage, p)
                for cid, p in payloads.items()}  # fmt: skip
        replies, failed = self.send(msgs, self.timeout)
        for cid, why in failed.items():
            self.failed.setdefault(cid, f"secure aggregation, {stage}: {why}")
        return self.payloads(replies)


def secure_sum(
    send: Callable[..., Any], nodes: Mapping[int, int], cfg: Mapping[str, Any],
    params: secagg.Params, adverts: list[dict[str, Any]], timeout: float,
) -> SecureResult:  # fmt: skip
    """Stages 2 to 4 after the TRAIN replies' `adverts`: the survivors' sum. `send({client:
    message}, timeout)` is the exchange (`deploy.messaging.Exchange.send`); `nodes`: each client's
    SuperNode; `cfg`: the run id and round every message names."""
    stages = _Stages(send, nodes, cfg, timeout)
    rnd, broadcast = secagg_server.server_keys(params, adverts)
    shares = stages.exchange(protocol.SECAGG_SHARE, dict.fromkeys(rnd.table, broadcast))
    rnd, inboxes = secagg_server.server_route(rnd, shares)
    for masked in stages.exchange(protocol.SECAGG_MASK, inboxes):
        rnd = secagg_server.server_add_masked(rnd, masked)
    request = secagg_server.unmask_request(rnd)
    responses = stages.exchange(protocol.SECAGG_UNMASK, dict.fromkeys(request["survivors"],
                                                                      request))  # fmt: skip
    agg = secagg_server.server_unmask(rnd, responses)
    refused = {**{int(v): why for v, why in agg.refused.items()}, **stages.refused}
    masked = 8 * params.length * len(agg.survivors)
    keys = stages.bytes_up + sum(map(payload_size, adverts))
    return SecureResult(agg.total, agg.survivors, stages.failed, refused, masked, keys)


def advert_of(reply: Any, cid: int) -> dict[str, Any]:
    """A TRAIN reply's advertisement (ValueError if it has none, or not from `cid`)."""
    try:
        return _payload(reply, cid)
    except secagg.Refused as error:
        raise ValueError(str(error)) from None

"""A node's side of secure aggregation (`deploy.secagg`): its fixed-point vector, its keys, and
the three messages after training.

The TRAIN message of a secure round carries the round's SecAgg+ settings; the node trains as in
any round, turns its update into its fixed-point vector (`fed.secure_sum.client_vector`: clipped
by the node itself, its weight inside) and replies with its advertisement instead of its upload.
Then the server's three queries: SHARE (encrypted Shamir shares of its seed and masking key for
the others), MASK (its masked vector), UNMASK (the shares it holds of the survivors' seeds and of
the dropped nodes' keys). Between them the node's round state (private keys, seed, vector) lives
in this process's memory only, never on disk or in a message: the node's warm worker
(`deploy.worker`) keeps it; a node without one cannot take part (each message would find a fresh
process). A node that restarts mid-round has lost its keys and counts as dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedjax_split.deploy import protocol, secagg, secagg_node
from fedjax_split.deploy.node import NodeSetup
from fedjax_split.fed.client_program import download
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.roles import select
from fedjax_split.fed.secure_sum import (
    client_vector,
    client_weight,
    round_bound,
    round_fixed_point,
)
from fedjax_split.fed.wire import param_count

_KEEP_ROUNDS = 2  # a node's round states kept (a run's latest rounds)


@dataclasses.dataclass
class _Round:
    state: secagg_node.NodeState
    vector: np.ndarray | None  # dropped once masked


_ROUNDS: dict[tuple[str, int, int], _Round] = {}  # (run id, round, client) -> the node's round


def settings(params: secagg.Params, fixed: FixedPoint) -> dict[str, Any]:
    """The SECAGG record of a secure round's TRAIN message: SecAgg+'s and the fixed point's."""
    return {**params.as_message(), "fp-clip": fixed.clip, "fp-max-weight": fixed.max_weight,
            "fp-max-nodes": fixed.max_nodes}  # fmt: skip


def start(
    node: NodeSetup, record: Any, run_id: str, upload: Any, global_wire: Any,
    trained: frozenset[str] | None, clip: float | None, norm: float | None,
) -> dict[str, Any]:  # fmt: skip
    """After training: this client's vector and fresh keys, kept in memory; the advertisement
    to reply with. `upload`: the trained global part as the wire carries it (fp32, DP-clipped
    already); `norm`: DP's update norm before clipping."""
    params = secagg.Params.from_message(dict(record))
    aggregator = node.round_spec.aggregator
    if not aggregator.secure:
        raise ValueError("the server asked for secure aggregation; this run's config has none")
    bound = round_bound(aggregator, clip)
    fixed = round_fixed_point(aggregator, clip, int(record["fp-max-weight"]), len(params.nodes))
    if float(record["fp-clip"]) != fixed.clip or int(record["fp-max-nodes"]) != fixed.max_nodes:
        raise ValueError(f"the server's fixed point (clip {record['fp-clip']}, "
                         f"{record['fp-max-nodes']} nodes) is not this round's (clip {fixed.clip}, "
                         f"{fixed.max_nodes} nodes)")  # fmt: skip
    received = download(global_wire, trained)[0]
    mine = select(upload, trained)[0]
    entries = param_count(received)
    if params.length != fixed.length(entries):
        raise ValueError(f"the server's vector length {params.length} is not this model's "
                         f"{fixed.length(entries)}")  # fmt: skip
    weight = client_weight(aggregator, len(node.split.train))
    return begin(run_id, params, node.client_id, client_vector(mine, received, weight, fixed,
                                                               bound, norm))  # fmt: skip


def begin(run_id: str, params: secagg.Params, client: int, vector: np.ndarray) -> dict[str, Any]:
    """Client `client`'s round with its fixed-point `vector`: fresh keys
    (`secagg_node.node_setup`), kept in memory with the vector until the round's shares are
    revealed; the advertisement."""
    state, advert = secagg_node.node_setup(params, client)
    _keep((run_id, params.round, client), _Round(state, vector))
    return advert


def forget(run_id: str) -> None:
    """Drops every round state of run `run_id` (what a node's restart does)."""
    for key in [k for k in _ROUNDS if k[0] == run_id]:
        del _ROUNDS[key]


def _keep(key: tuple[str, int, int], value: _Round) -> None:
    _ROUNDS[key] = value
    for old in sorted(k for k in _ROUNDS if k[0] == key[0] and k[2] == key[2])[:-_KEEP_ROUNDS]:
        del _ROUNDS[old]


def _round(cfg: Any) -> tuple[tuple[str, int, int], _Round]:
    key = (str(cfg[protocol.RUN]), int(cfg[protocol.ROUND]), int(cfg[protocol.CLIENT]))
    if key not in _ROUNDS:
        raise ValueError(
            f"no secure-aggregation keys for client {key[2]} in round {key[1]}: this node's worker "
            "restarted since it trained, or runs without one (warm-worker=false); secure "
            "aggregation keeps a round's keys in the node's warm worker"
        )
    return key, _ROUNDS[key]


def stage(kind: str, cfg: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """SHARE, MASK or UNMASK for the client and round `cfg` names: this node's reply payload
    (the masked vector under "masked")."""
    key, rnd = _round(cfg)
    if kind == protocol.SECAGG_SHARE:
        rnd.state, out = secagg_node.node_share_keys(rnd.state, payload)
    elif kind == protocol.SECAGG_MASK:
        if rnd.vector is None:
            raise secagg.UnsafeRequest("this round's masked vector was sent already")
        rnd.state, out = secagg_node.node_masked_input(rnd.state, payload, rnd.vector)
        rnd.vector = None
    elif kind == protocol.SECAGG_UNMASK:
        rnd.state, out = secagg_node.node_unmask(rnd.state, payload)
        del _ROUNDS[key]  # a round's shares are revealed once
    else:
        raise ValueError(f"unknown secure-aggregation stage {kind!r}")
    return out

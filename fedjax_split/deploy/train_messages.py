"""What the server sends for a round's training: each sampled client's TRAIN message
(`build_train_messages`: the global part as sent and the round's config), in a secure round its
SecAgg+ settings (`secure_settings`), and a round's training exchange held in memory (`Ahead`).

Both the round (`deploy.rounds`) and the evaluation before it, which carries the next round's
training in the same exchange (`deploy.evaluation.evaluate`), build their TRAIN messages here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedjax_split.deploy import codec, protocol, secagg, secure_node, secure_round
from fedjax_split.deploy.joining import ServerRun
from fedjax_split.deploy.messaging import config_record, new_message
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.roles import select
from fedjax_split.fed.strategy import RoundPlan
from fedjax_split.fed.wire import param_count


def build_train_messages(
    run: ServerRun, plan: RoundPlan, sent: Mapping[str, np.ndarray], keep_from: int,
    carry: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[int, Any]:  # fmt: skip
    """Round r's TRAIN message for each sampled client: the global part as sent, the round's
    config (the server state's round for the keys, the rounds whose local parts to keep, the
    paths a layer schedule trains this round, and with client-level DP the clip norm the client
    clips its update to). `carry`: {client: the config of round r-1's evaluation} for the
    clients whose message carries it (`deploy.evaluation.evaluate`)."""
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
        content = {protocol.CONFIG: config_record({**cfg, **extra, protocol.CLIENT: cid})}
        if sent:
            content[protocol.GLOBAL] = codec.to_record(sent)
        msgs[cid] = new_message(content, run.nodes[cid], protocol.TRAIN)
    return msgs


@dataclasses.dataclass
class Ahead:
    """Round r's training exchange: its plan, the global part sent, the replies and failures,
    the exchange's seconds and a secure round's settings. Sent in round r-1's evaluation
    exchange (`deploy.evaluation.evaluate`), its seconds count as round r's training (not as
    round r-1's evaluation); a round's own exchange (`deploy.rounds.run_round`) has none of its
    own. Held in memory only: a run stopped or killed before round r starts trains round r again
    on resume, as if it had never been sent."""

    plan: RoundPlan
    sent: Mapping[str, np.ndarray]
    replies: dict[int, Any]
    failed: dict[int, str]
    seconds: float
    secure: tuple[secagg.Params, FixedPoint] | None = None  # a secure round's settings, sent


def secure_settings(
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
        msg.content[protocol.SECAGG] = config_record(secure_node.settings(params, fixed))
    return params, fixed

"""A round's evaluation on the Flower server: every client scores the new global part with its
own local part on its own test split (`evaluate`). Before the last round the evaluation rides in
the next round's TRAIN messages: one exchange a round, the next round's replies held
(`deploy.train_messages.Ahead`) until it starts, so that this round's record is whole first.

An evaluate reply is untrusted: it must be the client's own JSON object of the task's metrics
(`metric_names`), each a real number or NaN (`eval_metrics`); else it is left out of the
evaluation and listed in `eval_failed`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedjax_split.deploy import codec, protocol
from fedjax_split.deploy.joining import ServerRun
from fedjax_split.deploy.messaging import (
    DeployOptions,
    Exchange,
    config_record,
    new_message,
    warn_line,
)
from fedjax_split.deploy.train_messages import Ahead, build_train_messages, secure_settings
from fedjax_split.run import client_scores


def metric_names(task: Any, tag_names: Sequence[str] = ()) -> frozenset[str]:
    """Every metric name the task's scoring (`run.client_scores.score`) can give a client: the
    task's metrics, MNLI's per group, a token task's `f1_<type>` of each entity type of its tags."""
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
    train = {} if plan is None else build_train_messages(run, plan, sent, keep_from, carry)
    secure = None if plan is None else secure_settings(run, plan, train)
    msgs = {**train}
    for cid in (c for c in due if c not in train):
        content = {protocol.CONFIG: config_record({**cfg, protocol.CLIENT: cid})}
        if sent:
            content[protocol.GLOBAL] = codec.to_record(sent)
        msgs[cid] = new_message(content, run.nodes[cid], protocol.EVALUATE)
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
            warn_line(f"round {r}: client {cid} failed to evaluate ({why})")
    return client_scores.personalised_record(per_client, trained, theirs if both else None), failed

"""One fine-tuning round over the federation (`run_round`): the strategy's plan and the TRAIN
exchange (or the one that went out with the previous round's evaluation), the replies taken
(`deploy.train_replies`), the server's step (the strategy's `aggregate` over the fp32 uploads, or
in a secure round SecAgg+'s stages, `deploy.secure_round`, then `aggregate_sum` from the
survivors' sum), the evaluation when due (`deploy.evaluation`) and the round's record for
metrics.jsonl.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from fedjax_split.deploy import codec, protocol, secagg, secure_round
from fedjax_split.deploy.evaluation import evaluate
from fedjax_split.deploy.joining import ServerRun
from fedjax_split.deploy.messaging import DeployOptions, Exchange
from fedjax_split.deploy.train_messages import Ahead, build_train_messages, secure_settings
from fedjax_split.deploy.train_replies import (
    Taken,
    check_replies,
    expected_costs,
    reply_figures,
    take_uploads,
)
from fedjax_split.fed.fixed_point import FixedPoint
from fedjax_split.fed.strategy import RoundPlan
from fedjax_split.run import driver, round_records


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
    training = _training(run, exchange, r, options, keep_from, ahead)
    t0 -= training.seconds
    plan, failed = training.plan, training.failed
    rejected: dict[int, str] = {}
    expect = expected_costs(run, plan.spec)
    taken, valid, agg_norms = _step(run, exchange, training, rejected, expect)
    weights = np.asarray(taken.weights, np.float32)
    jax.block_until_ready(run.server_state)
    t_train = time.perf_counter()
    record = run.strategy.record(plan, np.asarray(taken.losses, np.float64), weights,
                                 *taken.answered(rejected, valid, agg_norms))  # fmt: skip
    evaluated, eval_failed, eval_bytes, next_ahead = _evaluation(
        run, exchange, r, options, training, history, keep_from
    )
    record.update(evaluated)
    t_end = time.perf_counter() - (0.0 if next_ahead is None else next_ahead.seconds)
    times = (t0, t_train, max(t_end, t_train))
    record.update(_cost_record(run, history, training, taken, times, expect))
    record.update(clients_failed=sorted(failed), eval_failed=sorted(eval_failed),
                  eval_bytes_down=eval_bytes)  # fmt: skip
    if taken.secagg_bytes is not None:
        record["secagg_bytes_up"] = taken.secagg_bytes
    return record, next_ahead


def _training(
    run: ServerRun, exchange: Exchange, r: int, options: DeployOptions, keep_from: int,
    ahead: Ahead | None,
) -> Ahead:  # fmt: skip
    """Round r's training exchange: `ahead` where round r-1's evaluation carried it, else the
    strategy's plan sent now to the sampled clients (no seconds of its own: the round's clock
    runs already)."""
    if ahead is not None and ahead.plan.round == r:
        return ahead
    plan = run.strategy.plan(r, run.server_state, run.secret)  # DP, M < K: maybe nobody
    sent = codec.encode(run.server_state.global_params, run.model.round_spec.wire_dtype)
    msgs = build_train_messages(run, plan, sent, keep_from)
    secure = secure_settings(run, plan, msgs)
    replies, failed = exchange.send(msgs, options.round_timeout) if msgs else ({}, {})
    return Ahead(plan, sent, replies, failed, 0.0, secure)


def _step(
    run: ServerRun, exchange: Exchange, training: Ahead, rejected: dict[int, str],
    expect: tuple[str, ...],
) -> Stepped:  # fmt: skip
    """The round's server step after its TRAIN replies (`rejected` filled in here, and in a
    secure round the exchange's failures too): the plain one, or secure aggregation's."""
    outcome = (training.replies, training.failed, rejected)
    if training.secure is None:
        return _plain_step(run, training.plan, outcome, expect)
    # the server sees the sum alone
    return _secure_step(run, exchange, training.plan, training.secure, outcome, expect)


def _evaluation(
    run: ServerRun, exchange: Exchange, r: int, options: DeployOptions, training: Ahead,
    history: list[dict[str, Any]], keep_from: int,
) -> tuple[dict[str, Any], dict[int, str], int, Ahead | None]:  # fmt: skip
    """Round r's evaluation where it is due (`deploy.evaluation.evaluate`: its record, the
    clients that failed it, its own bytes, round r+1's training where it went in the same
    exchange), else nothing. The clients that failed round r's training are skipped."""
    if not driver.due(r, run.config.outputs.eval_every, run.rounds):
        return {}, {}, 0, None
    done = [c for c in training.plan.clients if int(c) not in training.failed]
    trained = round_records.trained_clients(history, done)
    return evaluate(run, exchange, r, options, training.failed, trained, keep_from)


def _cost_record(
    run: ServerRun, history: list[dict[str, Any]], training: Ahead, taken: Taken,
    times: tuple[float, float, float], expect: tuple[str, ...],
) -> dict[str, Any]:  # fmt: skip
    """The round's bytes, seconds and FLOPs as the simulation records them
    (`round_records.cost_record`): up, the taken uploads'; down, the global part to each sampled
    client; `times`, the round's start and the ends of its training and evaluation."""
    num = len(training.plan.clients)
    return round_records.cost_record(
        history, taken.bytes_up, codec.nbytes(training.sent) * num, times, taken.costs,
        bool(expect), run.bert_fl_bytes, num,
    )  # fmt: skip


Stepped = tuple[Taken, Any, Any]  # the uploads taken; accepted and update norms, each [taken]


def _plain_step(
    run: ServerRun, plan: RoundPlan,
    outcome: tuple[dict[int, Any], dict[int, str], dict[int, str]], expect: tuple[str, ...],
) -> Stepped:  # fmt: skip
    """A round after its TRAIN replies (`outcome`: replies, failed, rejected; the last filled in
    here): the valid uploads taken, then the strategy's server step over them."""
    replies, failed, rejected = outcome
    taken = take_uploads(run, plan.spec, replies, rejected, expect)
    check_replies(plan.round, plan.clients, replies, failed, rejected)
    weights = np.asarray(taken.weights, np.float32)
    norms = None if taken.norms is None else np.asarray(taken.norms, np.float32)
    run.server_state, valid, agg_norms = run.strategy.aggregate(
        plan, run.server_state, taken.uploads, weights, norms)  # fmt: skip
    return taken, valid, agg_norms


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
    check_replies(plan.round, plan.clients, replies, failed, rejected)
    run.server_state = run.strategy.aggregate_sum(plan, run.server_state, result.total, fixed)
    num = len(taken.clients)
    return taken, np.ones(num, bool), np.zeros(num, np.float32)

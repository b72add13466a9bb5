"""The Flower server (deploy.server and the modules of its round: deploy.joining, train_replies,
evaluation; tests/test_server.py is fed/server.py's): what it takes from the nodes' replies. A
reply whose upload is malformed (paths, shapes, dtypes), holds a NaN or an infinity, or whose
figures are not finite or not the node's own example count, is left out of the round and
recorded as rejected; the others are taken, example-weighted, in client order. The
whole server over real Flower processes is tests/test_flower.py's."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from fedjax_split.data.partition import ClientSplit
from fedjax_split.deploy import (
    codec,
    evaluation,
    joining,
    messaging,
    protocol,
    server,
    train_messages,
)
from fedjax_split.deploy.train_replies import take_uploads
from fedjax_split.errors import UserError
from fedjax_split.fed import privacy
from fedjax_split.fed.aggregation import Aggregator
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.server_optimizers import fedavg
from fedjax_split.run.config import ExperimentConfig

GLOBAL = {"layer": {"kernel": jnp.ones((2, 3), jnp.float32), "bias": jnp.zeros(3, jnp.float32)}}


# each client's training examples as its node reported them when it joined (the partition)
SIZES = {0: 10, 1: 10, 2: 10, 3: 10, 4: 30, 5: 10, 6: 10, 7: 10, 8: 10, 9: 10}


def _run(wire: str, dp: bool = False) -> SimpleNamespace:
    dp_spec = privacy.DPSpec(clip=1.0, noise_multiplier=1.0, denominator=3.0) if dp else None
    spec = SimpleNamespace(wire_dtype=wire, trained=None, server_optimizer=fedavg(),
                           aggregator=Aggregator(dp=dp_spec))  # fmt: skip
    state = init_server_state(GLOBAL, spec.server_optimizer, wire)
    clients = {c: ClientSplit(np.arange(n), np.arange(0)) for c, n in SIZES.items()}
    return SimpleNamespace(model=SimpleNamespace(round_spec=spec), server_state=state,
                           partition=SimpleNamespace(clients=clients))  # fmt: skip


def _reply(
    upload: dict, wire: str, examples: float, loss_sum: float, **extra: float
) -> SimpleNamespace:
    """A TRAIN reply's content as a node's ClientApp writes it (`extra`: more metrics)."""
    metrics = {protocol.NUM_TRAIN: examples, protocol.LOSS_SUM: loss_sum,
               protocol.LOSS_UNITS: examples, **extra}  # fmt: skip
    content = RecordDict({
        protocol.UPLOAD: codec.to_record(codec.encode(upload, wire)),
        protocol.METRICS: MetricRecord(metrics),
    })  # fmt: skip
    return SimpleNamespace(content=content)


@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_bad_uploads_are_rejected_and_the_rest_is_taken_in_order(wire: str) -> None:
    good = {"layer": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, 0.5)}}
    nan = {"layer": {"kernel": jnp.full((2, 3), jnp.nan), "bias": jnp.zeros(3)}}
    inf = {"layer": {"kernel": jnp.ones((2, 3)), "bias": jnp.full(3, jnp.inf)}}
    wrong_shape = {"layer": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(3)}}
    other = {"layer": {"kernel": jnp.full((2, 3), 4.0), "bias": jnp.zeros(3)}}
    replies = {
        4: _reply(other, wire, 30.0, 3.0),
        0: _reply(good, wire, 10.0, 5.0),
        1: _reply(nan, wire, 10.0, 1.0),
        2: _reply(inf, wire, 10.0, 1.0),
        3: _reply(wrong_shape, wire, 10.0, 1.0),
        5: _reply(good, wire, 1e9, 1.0),  # claims far more examples than its node holds
        6: _reply(good, wire, 10.0, float("nan")),
        8: _reply(good, wire, -10.0, 1.0),
    }
    # a float32 array where the wire carries 16-bit bits (or bits where it carries float32)
    wrong_dtype = {"layer/kernel": np.full((2, 3), 2, np.float32 if wire != "float32" else
                                           np.uint16), "layer/bias": np.zeros(3, np.float32)}
    replies[9] = SimpleNamespace(content=RecordDict({
        protocol.UPLOAD: codec.to_record(wrong_dtype),
        protocol.METRICS: MetricRecord({protocol.NUM_TRAIN: 10.0, protocol.LOSS_SUM: 1.0,
                                        protocol.LOSS_UNITS: 10.0}),
    }))  # fmt: skip
    rejected: dict[int, str] = {}
    run = _run(wire)
    taken = take_uploads(run, run.model.round_spec, replies, rejected)
    assert sorted(rejected) == [1, 2, 3, 5, 6, 8, 9]
    assert "non-finite" in rejected[1] and "non-finite" in rejected[2] and "shape" in rejected[3]
    assert "example count" in rejected[5] and "loss sum" in rejected[6]
    assert "example count" in rejected[8] and "arrived as" in rejected[9]
    assert taken.clients == [0, 4] and taken.weights == [10.0, 30.0]  # in client order
    assert taken.losses == [0.5, float(np.float32(3.0) / np.float32(30.0))]  # fp32, as simulated
    np.testing.assert_array_equal(np.asarray(taken.uploads[0]["layer"]["kernel"]),
                                  np.full((2, 3), 2.0))  # fmt: skip
    assert taken.uploads[1]["layer"]["kernel"].dtype == jnp.float32  # decoded to fp32 for the mean
    assert taken.norms is None  # no DP: the server measures what it needs itself
    per_client = (6 + 3) * (4 if wire == "float32" else 2)
    assert taken.bytes_up == 2 * per_client  # the two taken uploads' bytes as sent


def test_with_dp_a_reply_must_report_a_finite_update_norm() -> None:
    good = {"layer": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, 0.5)}}
    norm = protocol.UPDATE_NORM
    replies = {
        0: _reply(good, "float32", 10.0, 1.0, **{norm: 3.5}),
        1: _reply(good, "float32", 10.0, 1.0),  # no norm
        2: _reply(good, "float32", 10.0, 1.0, **{norm: float("inf")}),
        4: _reply(good, "float32", 30.0, 1.0, **{norm: 0.25}),
    }
    rejected: dict[int, str] = {}
    run = _run("float32", dp=True)
    taken = take_uploads(run, run.model.round_spec, replies, rejected)
    assert sorted(rejected) == [1, 2] and "update norm" in rejected[1]
    assert taken.clients == [0, 4] and taken.norms == [3.5, 0.25]


def test_sites_partition_is_rebuilt_from_the_counts_and_own_indices_the_nodes_report() -> None:
    """--site-data: each node reports indices into its own rows and its own row count; the
    server offsets them as the simulation concatenates the sites (client order)."""
    import json

    from fedjax_split.data.partition import SITES

    meta = json.dumps({"scheme": SITES, "num_clients": 2, "seed": 4, "alpha": None,
                       "beta": None, "task": "sst2", "test_fraction": 0.2, "fill": None,
                       "target_shares": None, "dropped": 0})  # fmt: skip
    found = {
        1: (11, {protocol.SPLIT_TRAIN: [0, 2], protocol.SPLIT_TEST: [1],
                 protocol.POOL_SIZE: 3, protocol.PARTITION: meta}),
        0: (10, {protocol.SPLIT_TRAIN: [1, 3, 4], protocol.SPLIT_TEST: [0],
                 protocol.POOL_SIZE: 5, protocol.PARTITION: meta}),
    }  # fmt: skip
    part = joining.partition_from_nodes(ExperimentConfig.of(clients=2), found)
    assert [(c.train.tolist(), c.test.tolist()) for c in part.clients] == [
        ([1, 3, 4], [0]), ([5, 7], [6])]  # fmt: skip
    assert (part.scheme, part.num_examples, part.seed, part.task) == (SITES, 8, 4, "sst2")


def test_the_tag_names_are_the_configs_and_every_node_must_report_them() -> None:
    """A token task's vocabulary comes from the run config; the nodes' reports are checked
    against it, and only without one (a pool's own tags) do they decide it."""
    tags = ["O", "B-x", "I-x"]
    found = {0: (10, {protocol.TAG_NAMES: tags}), 1: (11, {protocol.TAG_NAMES: tags})}
    assert joining._tag_names(found, tuple(tags)) == tuple(tags) == joining._tag_names(found)
    with pytest.raises(UserError, match="report the tags O,B-x,I-x, the run's are O,B-y,I-y"):
        joining._tag_names(found, ("O", "B-y", "I-y"))
    found[1] = (11, {protocol.TAG_NAMES: ["O", "B-y", "I-y"]})
    with pytest.raises(UserError, match="different tag vocabularies"):
        joining._tag_names(found, tuple(tags))


def test_partition_names_of_a_token_task_come_from_the_config() -> None:
    from fedjax_split.run.config import resolve_config
    from fedjax_split.tasks.registry import get_task

    config = resolve_config(overrides={"task": "ner", "entity_types": "pos,neg"})
    assert joining.partition_names(config, get_task("ner")) == ("neg", "pos", "(none)")
    assert joining.partition_names(resolve_config(), get_task("ner")) is None
    assert joining.partition_names(resolve_config(), get_task("sst2")) == ("negative", "positive")
    assert joining.partition_names(resolve_config(), get_task("stsb")) is None


class _Grid:
    """A Flower Grid whose nodes answer a query at once with the given reply contents."""

    def __init__(self, replies: dict[int, RecordDict]) -> None:
        self.replies, self.sent = replies, {}

    def get_node_ids(self) -> list[int]:
        return list(self.replies)

    def push_messages(self, messages: list) -> list[str]:
        ids = []
        for m in messages:
            ids.append(f"m{m.metadata.dst_node_id}")
            self.sent[ids[-1]] = m.metadata.dst_node_id
        return ids

    def pull_messages(self, ids: list[str]) -> list:
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i),
                                has_error=lambda: False, content=self.replies[self.sent[i]])
                for i in ids]  # fmt: skip


def _query_reply(*clients: int, single: bool = False, drop: int | None = None) -> RecordDict:
    from flwr.app import ConfigRecord

    if single:
        return RecordDict({protocol.CONFIG: ConfigRecord({protocol.CLIENT: clients[0]})})
    records = {protocol.CONFIG: ConfigRecord({protocol.CLIENTS: list(clients)})}
    for c in clients:
        if c != drop:
            records[protocol.client_record(c)] = ConfigRecord({protocol.CLIENT: c,
                                                               protocol.POOL_SIZE: 100 + c})
    return RecordDict(records)


def test_connect_maps_each_client_to_the_node_that_holds_it(monkeypatch) -> None:
    """A node of clients 0 and 1 and a node of client 2 (a one-client reply, as pre-training's
    query gives): every client maps to its node and its own record; a client claimed twice, or
    named without its record, stops the run with one line."""
    from fedjax_split.errors import UserError

    # a Flower Message needs a run's task identity: the query is only addressed here
    monkeypatch.setattr(joining, "new_message", lambda content, node, kind: SimpleNamespace(
        metadata=SimpleNamespace(dst_node_id=node, message_type=kind)))  # fmt: skip

    config = ExperimentConfig.of(clients=3)
    options = messaging.DeployOptions(connect_timeout=5, poll_interval=0.01)
    grid = _Grid({11: _query_reply(0, 1), 12: _query_reply(2, single=True)})
    found = joining.connect(grid, config, options)
    assert {c: node for c, (node, _) in found.items()} == {0: 11, 1: 11, 2: 12}
    assert found[1][1][protocol.POOL_SIZE] == 101 and found[2][1][protocol.CLIENT] == 2
    with pytest.raises(UserError, match="two SuperNodes say partition-id 1"):
        joining.connect(_Grid({11: _query_reply(0, 1), 12: _query_reply(1, 2)}), config, options)
    with pytest.raises(UserError, match="SuperNode 11 answered the query for client 1 without"):
        joining.connect(_Grid({11: _query_reply(0, 1, 2, drop=1)}), config, options)


def _eval_reply(
    client: object, text: object = None, *, no_config: bool = False, initial: object = None
) -> Any:
    """An EVALUATE reply's content as a node's ClientApp writes it (its id, its metrics' JSON;
    `initial`: the global model's, when the server asked for them)."""
    from flwr.app import ConfigRecord

    if no_config:
        return SimpleNamespace(content=RecordDict({}))
    values = {protocol.CLIENT: client}
    if text is not None:
        values[protocol.EVAL_JSON] = text
    if initial is not None:
        values[protocol.GLOBAL_EVAL_JSON] = initial
    return SimpleNamespace(content=RecordDict({protocol.CONFIG: ConfigRecord(values)}))


class _Exchange:
    """An Exchange whose clients answer an evaluation at once with the given replies; it keeps
    the messages it was given."""

    def __init__(self, replies: dict[int, Any], failing: dict[int, str] | None = None) -> None:
        self.replies = replies
        self.failing = failing or {}
        self.sent: dict = {}

    def send(self, messages: dict, timeout: float) -> tuple[dict, dict]:
        self.sent = messages
        failed = {c: why for c, why in self.failing.items() if c in messages}
        return {c: self.replies[c] for c in messages if c not in failed}, failed


def test_evaluate_leaves_out_a_reply_that_is_not_the_clients_own_metrics(monkeypatch) -> None:
    """An evaluate reply is untrusted: no record, bad JSON, a list, a string or infinite value, a
    "client" key (claiming another's row), a metric the task does not score, another client's id,
    or an oversized text is left out (eval_failed, warned) and the server goes on; NaN (a metric
    undefined on a split) and {} (no test examples) are taken as before."""
    from fedjax_split.tasks.registry import get_task

    monkeypatch.setattr(evaluation, "new_message", lambda content, node, kind: content)
    nan = float("nan")
    replies = {
        0: _eval_reply(0, json.dumps({"accuracy": 0.75})),
        1: _eval_reply(1, json.dumps({"accuracy": nan})),
        2: _eval_reply(2, "{}"),
        3: _eval_reply(3, no_config=True),
        4: _eval_reply(4),
        5: _eval_reply(5, "{not json"),
        6: _eval_reply(6, "[0.5]"),
        7: _eval_reply(7, json.dumps({"accuracy": "high"})),
        8: _eval_reply(8, json.dumps({"accuracy": 0.5, "client": 0})),
        9: _eval_reply(9, json.dumps({"accuracy": 0.5, "note": "x"})),
        10: _eval_reply(0, json.dumps({"accuracy": 0.5})),
        11: _eval_reply(11, json.dumps({"accuracy": float("inf")})),
        12: _eval_reply(12, json.dumps({"accuracy": 0.5, "pad": "x" * 10**6})),
        13: _eval_reply(13, "[" * 10**4),
        14: _eval_reply(14, json.dumps({"accuracy": True})),
        15: _eval_reply(15, json.dumps({"f1": 0.5})),
    }
    run = _run("float32")
    run.model.task, run.tag_names, run.run_id = get_task("qnli"), (), "ab" * 8
    run.config, run.nodes = ExperimentConfig.of(clients=len(replies)), {c: c for c in replies}
    run.rounds, run.model.num_local = 1, 0  # the last evaluation, but nothing local
    record, failed, _, ahead = evaluation.evaluate(run, _Exchange(replies), 1,
                                                   messaging.DeployOptions(), {},
                                                   set(range(16)))  # fmt: skip
    assert ahead is None  # the last round: nothing to carry
    assert sorted(failed) == list(range(3, 16))
    assert all(why.startswith("bad evaluation: ") for why in failed.values())
    assert "client 0" in failed[10] and "not a real number" in failed[7]
    assert [pc["client"] for pc in record["clients"]] == [0, 1]
    assert record["accuracy"] == 0.75 and np.isnan(record["clients"][1]["accuracy"])
    assert set(record["clients"][0]) == {"client", "accuracy"}


def test_a_split_runs_last_evaluation_asks_every_client_for_the_global_models_figures(
    monkeypatch,
) -> None:
    """With a local part, the last evaluation's messages ask for the global model's figures too
    (none before it); each client's reply carries both, checked alike: a reply without the
    global model's is a bad evaluation, a client without test rows ({} twice) is left out; the
    record has them per client and the gain, each client's own difference averaged."""
    from fedjax_split.tasks.registry import get_task

    monkeypatch.setattr(evaluation, "new_message", lambda content, node, kind: content)
    acc = lambda a: json.dumps({"accuracy": a})  # noqa: E731
    replies = {
        0: _eval_reply(0, acc(0.9), initial=acc(0.5)),
        1: _eval_reply(1, acc(0.6), initial=acc(0.7)),
        2: _eval_reply(2, "{}", initial="{}"),  # no test split
        3: _eval_reply(3, acc(0.8)),  # its global figures missing
        4: _eval_reply(4, acc(0.8), initial=acc(float("inf"))),
    }
    run = _run("float32")
    run.model.task, run.tag_names, run.run_id = get_task("qnli"), (), "ab" * 8
    run.config, run.nodes = ExperimentConfig.of(clients=len(replies)), {c: c for c in replies}
    run.rounds, run.model.num_local = 4, 10
    exchange = _Exchange(replies)
    alone = messaging.DeployOptions(carry_evaluation=False)  # (carried: the next test)
    early, _, _, _ = evaluation.evaluate(run, exchange, 2, alone, {}, set())
    assert not any(protocol.GLOBAL_EVAL in m[protocol.CONFIG] for m in exchange.sent.values())
    assert "personalization_gain" not in early
    options = messaging.DeployOptions()
    record, failed, _, _ = evaluation.evaluate(run, exchange, 4, options, {}, set())
    assert all(m[protocol.CONFIG][protocol.GLOBAL_EVAL] is True for m in exchange.sent.values())
    assert sorted(failed) == [3, 4] and protocol.GLOBAL_EVAL_JSON in failed[3]
    assert record["clients"] == [{"client": 0, "accuracy": 0.9}, {"client": 1, "accuracy": 0.6}]
    assert record["global_clients"] == [{"client": 0, "accuracy": 0.5},
                                        {"client": 1, "accuracy": 0.7}]  # fmt: skip
    assert record["personalization_gain"]["accuracy"] == pytest.approx(((0.9 - 0.5) - 0.1) / 2)
    assert record["worst_client"] == {"accuracy": 0.6}


def test_before_the_last_round_the_evaluation_rides_in_the_next_rounds_train_messages(
    monkeypatch,
) -> None:
    """Round 2 of 3, evaluation due; round 3 samples clients 0, 2 and 3, and 3 failed to train
    in round 2: one exchange, in which 0 and 2 get round 3's train message carrying round 2's
    evaluation, 3 round 3's train message alone, 1 (not sampled) an evaluate message, each with
    the same global part. Client 2's message fails: its evaluation and its training both. The
    replies of round 3's messages wait for round 3; the evaluation's own bytes are one global
    part. Without `carry_evaluation` every due client gets an evaluate message and nothing
    waits."""
    from fedjax_split.fed.strategy import RoundPlan
    from fedjax_split.tasks.registry import get_task

    def message(content: dict, node: int, kind: str) -> dict:
        return {**content, "kind": kind}

    # the evaluate messages are built in deploy.evaluation, the train messages in
    # deploy.train_messages: each looks `new_message` up in its own module
    monkeypatch.setattr(evaluation, "new_message", message)
    monkeypatch.setattr(train_messages, "new_message", message)
    acc = lambda a: json.dumps({"accuracy": a})  # noqa: E731
    replies = {c: _eval_reply(c, acc(0.5 + c / 10)) for c in range(4)}
    run = _run("float32")
    run.model.task, run.tag_names, run.run_id = get_task("qnli"), (), "ab" * 8
    run.config, run.nodes = ExperimentConfig.of(clients=4), {c: c for c in range(4)}
    run.rounds, run.model.num_local, run.secret = 3, 10, None
    spec = run.model.round_spec
    run.strategy = SimpleNamespace(plan=lambda r, state, secret: RoundPlan(
        r, np.asarray([0, 2, 3]), spec, None, None))  # fmt: skip
    exchange = _Exchange(replies, failing={2: "no reply within 9 s"})
    skip = {3: "no reply within 9 s"}
    record, failed, eval_bytes, ahead = evaluation.evaluate(
        run, exchange, 2, messaging.DeployOptions(), skip, {0, 1, 2}, keep_from=1
    )
    sent = {c: (m["kind"], dict(m[protocol.CONFIG])) for c, m in exchange.sent.items()}
    kinds = {c: kind for c, (kind, _) in sent.items()}
    assert kinds == {0: protocol.TRAIN, 1: protocol.EVALUATE, 2: protocol.TRAIN, 3: "train"}
    assert [sent[c][1][protocol.ROUND] for c in range(4)] == [3, 2, 3, 3]
    carried = {c: cfg.get(protocol.EVAL_ROUND) for c, (_, cfg) in sent.items()}
    assert carried == {0: 2, 1: None, 2: 2, 3: None}
    assert all(cfg[protocol.KEEP_FROM] == 1 for kind, cfg in sent.values() if kind == "train")
    global_part = codec.encode(run.server_state.global_params, "float32")
    for m in exchange.sent.values():
        got = codec.from_record(m[protocol.GLOBAL])
        assert all(np.array_equal(got[p], x) for p, x in global_part.items())
    assert [c["client"] for c in record["clients"]] == [0, 1]
    assert record["accuracy"] == pytest.approx((0.5 + 0.6) / 2)
    assert failed == {2: "no reply within 9 s", 3: "no reply within 9 s"}
    assert eval_bytes == codec.nbytes(global_part)  # client 1's evaluate message alone
    assert ahead.plan.round == 3 and sorted(ahead.replies) == [0, 3]
    assert ahead.replies[0] is replies[0] and ahead.failed == {2: "no reply within 9 s"}
    assert ahead.sent.keys() == global_part.keys()

    alone = messaging.DeployOptions(carry_evaluation=False)
    _, failed, eval_bytes, ahead = evaluation.evaluate(run, exchange, 2, alone, skip, {0, 1, 2})
    kinds = {c: m["kind"] for c, m in exchange.sent.items()}
    assert kinds == dict.fromkeys([0, 1, 2], protocol.EVALUATE)
    assert ahead is None and eval_bytes == 3 * codec.nbytes(global_part)


def test_the_metric_names_are_the_tasks_with_groups_and_entity_types() -> None:
    from fedjax_split.tasks.registry import get_task

    assert evaluation.metric_names(get_task("mnli")) == {"accuracy", "accuracy_matched",
                                                     "accuracy_mismatched"}  # fmt: skip
    names = evaluation.metric_names(get_task("ner"), ("O", "B-PER", "I-PER", "B-LOC", "I-LOC"))
    assert names == {"precision", "recall", "f1", "f1_PER", "f1_LOC"}


POOL_META = {"scheme": "iid", "num_clients": 2, "seed": 4, "num_examples": 10, "alpha": None,
             "beta": None, "task": "sst2", "test_fraction": 0.2, "fill": None,
             "target_shares": None, "dropped": 0}  # fmt: skip


def _pool_found(**changes: dict) -> dict:
    """Two clients' query records of a 10-example pool; `changes`: client ("c0", "c1") -> keys
    to replace (None: leave the key out)."""
    records = {
        0: {protocol.SPLIT_TRAIN: [0, 1, 2, 3], protocol.SPLIT_TEST: [4], protocol.POOL_SIZE: 10,
            protocol.PARTITION: json.dumps(POOL_META), protocol.SHARES: "[0.5, 0.5]"},
        1: {protocol.SPLIT_TRAIN: [5, 6, 7, 8], protocol.SPLIT_TEST: [9], protocol.POOL_SIZE: 10,
            protocol.PARTITION: json.dumps(POOL_META), protocol.SHARES: "null"},
    }  # fmt: skip
    for key, values in changes.items():
        record = records[int(key[1:])]
        record.update(values)
        for k in [k for k, v in record.items() if v is None]:
            del record[k]
    return {c: (10 + c, record) for c, record in records.items()}


BAD_QUERIES = {
    "index past the pool": ({"c1": {protocol.SPLIT_TEST: [10]}}, "SuperNode 11 .*outside 0..9"),
    "negative index": ({"c0": {protocol.SPLIT_TRAIN: [-1, 1]}}, "SuperNode 10 .*outside"),
    "float index": ({"c0": {protocol.SPLIT_TRAIN: [0.5]}}, "SuperNode 10 .*whole numbers"),
    "no test split": ({"c1": {protocol.SPLIT_TEST: None}}, "SuperNode 11 .*test indices"),
    "repeated index": ({"c0": {protocol.SPLIT_TRAIN: [0, 0, 1]}}, "SuperNode 10 .*repeated"),
    "train and test": ({"c0": {protocol.SPLIT_TEST: [3]}}, "SuperNode 10 .*repeated"),
    "another's example": ({"c1": {protocol.SPLIT_TEST: [4]}},
                          "SuperNodes 10 and 11 both report pool example 4"),
    "other pool size": ({"c1": {protocol.POOL_SIZE: 12}}, "pools of \\[10, 12\\] examples"),
    "no pool size": ({"c0": {protocol.POOL_SIZE: None}}, "SuperNode 10 .*pool size"),
    "no partition": ({"c0": {protocol.PARTITION: None}, "c1": {protocol.PARTITION: None}},
                     "SuperNode 1. .*partition settings"),
    "not JSON": ({"c0": {protocol.PARTITION: "{"}}, "SuperNode 10 .*partition settings"),
    "unknown setting": ({"c0": {protocol.PARTITION: json.dumps({**POOL_META, "evil": 1})},
                         "c1": {protocol.PARTITION: json.dumps({**POOL_META, "evil": 1})}},
                        "SuperNode 1. .*partition settings"),
    "no scheme": ({"c0": {protocol.PARTITION: json.dumps({"seed": 1})},
                   "c1": {protocol.PARTITION: json.dumps({"seed": 1})}},
                  "SuperNode 1. .*partition settings"),
    "missing setting": ({"c0": {protocol.PARTITION: json.dumps({"scheme": "iid"})},
                         "c1": {protocol.PARTITION: json.dumps({"scheme": "iid"})}},
                        "SuperNode 10 .*lacks or mistypes"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_QUERIES))
def test_a_malformed_query_reply_is_one_line_naming_the_supernode(case: str) -> None:
    """The nodes' reported splits are untrusted too: indices outside the pool, repeated, shared
    with another client, another pool's size or settings the server cannot read stop the run
    with one line that says which SuperNode to look at, never a traceback."""
    changes, needle = BAD_QUERIES[case]
    found = _pool_found(**changes)
    with pytest.raises(UserError, match=needle):
        joining.partition_from_nodes(ExperimentConfig.of(clients=2), found)


def test_a_good_pool_query_is_the_partition_and_bad_shares_are_one_line() -> None:
    found = _pool_found()
    part = joining.partition_from_nodes(ExperimentConfig.of(clients=2), found)
    assert [(c.train.tolist(), c.test.tolist()) for c in part.clients] == [
        ([0, 1, 2, 3], [4]), ([5, 6, 7, 8], [9])]  # fmt: skip
    assert (part.scheme, part.num_examples, part.seed) == ("iid", 10, 4)
    assert joining._shares(*found[0], 0) == [0.5, 0.5] and joining._shares(*found[1], 1) is None
    for bad in ("[0.5,", '{"a": 1}', '["x"]', "[NaN]", "[2.0]"):
        with pytest.raises(UserError, match="SuperNode 11 .*client 1's label shares"):
            joining._shares(11, {protocol.SHARES: bad}, 1)


def test_a_site_reports_indices_within_its_own_rows() -> None:
    """--site-data: a site's indices are into its own rows (POOL_SIZE its row count)."""
    meta = json.dumps({"scheme": "sites", "num_clients": 1, "seed": 4, "alpha": None,
                       "beta": None, "task": "sst2", "test_fraction": 0.2, "fill": None,
                       "target_shares": None, "dropped": 0})  # fmt: skip
    site = {protocol.SPLIT_TRAIN: [0, 1], protocol.SPLIT_TEST: [2], protocol.PARTITION: meta}
    found = {0: (10, {**site, protocol.POOL_SIZE: 3}), 1: (11, {**site, protocol.POOL_SIZE: 5})}
    assert joining.partition_from_nodes(ExperimentConfig.of(clients=2), found).num_examples == 8
    for size, needle in ((2, "outside 0..1"), (-1, "pool size -1"), (2.5, "pool size 2.5")):
        found[1] = (11, {**site, protocol.POOL_SIZE: size})
        with pytest.raises(UserError, match=f"SuperNode 11 .*{needle}"):
            joining.partition_from_nodes(ExperimentConfig.of(clients=2), found)


def test_a_query_reply_without_a_client_id_is_one_line(monkeypatch) -> None:
    from flwr.app import ConfigRecord

    monkeypatch.setattr(joining, "new_message", lambda content, node, kind: SimpleNamespace(
        metadata=SimpleNamespace(dst_node_id=node, message_type=kind)))  # fmt: skip
    options = messaging.DeployOptions(connect_timeout=5, poll_interval=0.01)
    for content, needle in ((RecordDict({}), "no config record"),
                            (RecordDict({protocol.CONFIG: ConfigRecord({})}), "no client id"),
                            (RecordDict({protocol.CONFIG: ConfigRecord({protocol.CLIENTS: "x"})}),
                             "client ids")):  # fmt: skip
        with pytest.raises(UserError, match=f"SuperNode 12 answered the query with {needle}"):
            joining.connect(_Grid({12: content}), ExperimentConfig.of(clients=1), options)


def test_the_nodes_keep_the_local_parts_of_the_oldest_kept_checkpoint(
    tmp_path, monkeypatch
) -> None:
    """KEEP_FROM is the oldest kept checkpoint's round, as the simulation prunes its client
    store to min(kept): `export --round` and `--resume` from an older kept checkpoint find the
    nodes' local parts. After a resume, the checkpoints on disk say which is oldest."""
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir

    sent: list[int] = []
    carried: list = []

    def run_round(run, ex, r, h, o, keep, ahead):  # noqa: ANN001, ANN202
        sent.append(keep)
        carried.append(ahead)
        return {}, f"round {r + 1}'s training"  # what the next step gets

    monkeypatch.setattr(server, "run_round", run_round)
    task = SimpleNamespace(primary_metric="f1")
    run = SimpleNamespace(config=ExperimentConfig.of(output_dir=str(tmp_path)), rounds=9,
                          model=SimpleNamespace(task=task))  # fmt: skip
    flower = server.FlowerServer(run, None, messaging.DeployOptions())
    flower.step(1, [])
    flower.checkpointed(2, [2])
    flower.step(3, [])
    flower.checkpointed(4, [2, 4])
    flower.step(5, [])
    assert sent == [0, 2, 2]
    assert carried == [None, "round 2's training", "round 4's training"]
    checkpoints = RunCheckpointer(checkpoint_dir(tmp_path))
    for r in (2, 4):
        checkpoints.save(r, {"x": np.zeros(1)}, {})
    assert server.oldest_checkpoint(tmp_path, 4) == 2
    assert server.oldest_checkpoint(tmp_path / "none", 4) == 4
    assert server.oldest_checkpoint(tmp_path, 0) == 0


def test_a_train_reply_must_carry_its_flops_as_a_whole_number() -> None:
    """When the round's FLOPs are counted, each reply reports its own as an integer (they pass
    2**53 on bert-base: a float would lose the simulation's exact figure); missing, fractional
    or negative figures reject the reply, and a taken one keeps its count exactly."""
    good = {"layer": {"kernel": jnp.full((2, 3), 2.0), "bias": jnp.full(3, 0.5)}}
    big = 2**60 + 1
    replies = {
        0: _reply(good, "float32", 10.0, 1.0, **{protocol.FLOPS: big}),
        1: _reply(good, "float32", 10.0, 1.0),
        2: _reply(good, "float32", 10.0, 1.0, **{protocol.FLOPS: 1.5}),
        4: _reply(good, "float32", 30.0, 1.0, **{protocol.FLOPS: -3}),
    }
    rejected: dict[int, str] = {}
    run = _run("float32")
    taken = take_uploads(run, run.model.round_spec, replies, rejected, ("flops",))
    assert sorted(rejected) == [1, 2, 4] and all("flops" in why for why in rejected.values())
    assert taken.clients == [0] and taken.costs == [{"flops": big}]

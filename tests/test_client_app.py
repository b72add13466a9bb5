"""deploy.client_app's handlers, called in this process through the ClientApp (which routes by
message type) with Flower Message and Context objects, on a tiny BERT: what a query, a train and an
evaluate reply carry, and which messages a node refuses before touching its disk.

Messages are built with explicit metadata, as the SuperLink would deliver them; no Flower
process is started. The bitwise equality of a node's rounds with the simulation's is
tests/test_flower.py's (real processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict
from run_fixtures import private_cache, write_tiny_model, write_tiny_sst2  # noqa: F401 (autouse)

from fedjax_split.deploy import client_app, codec, protocol
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import flatten_paths

RUN = "0123456789abcdef"
CLIENT = 1
NODE_ID = 11


@pytest.fixture(autouse=True)
def in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers run here, not in a node's warm worker (tests/test_worker.py tests that)."""
    from fedjax_split.deploy import worker

    monkeypatch.setenv(worker.ENV, "0")


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A resolved 3-client config (critical layer 1 of 2, fp16 wire) and the global part the
    server sends in round 1, as it sends it."""
    from fedjax_split.run import client_data, pieces
    from fedjax_split.run.config import resolve_config
    from fedjax_split.tasks import registry as tasks

    base = tmp_path_factory.mktemp("client_app")
    config = resolve_config(overrides={
        "task": "sst2", "model": str(write_tiny_model(base / "model")),
        "data_dir": str(write_tiny_sst2(base / "data")), "output_dir": str(base / "run"),
        "clients": 3, "critical_layer": 1, "quantize": "fp16", "rounds": 2, "local_epochs": 1,
        "batch_size": 32, "lr": 1e-3, "max_length": 16, "seed": 0,
    })  # fmt: skip
    task = tasks.get_task("sst2")
    model = pieces.build_model(config, task)
    wire = model.round_spec.wire_dtype
    pool = client_data.load_pool(config, task)
    partition = client_data.make_partition(config, task, np.asarray(pool.labels))
    return SimpleNamespace(config=config, wire=wire, sent=codec.encode(model.global0, wire),
                           local0=model.local0, partition=partition, pool_size=len(pool.labels))


def _context(fed: SimpleNamespace, state_dir: Path, client: int = CLIENT) -> Context:
    return Context(
        run_id=1, node_id=NODE_ID, state=RecordDict(),
        node_config={protocol.PARTITION_ID: client, protocol.STATE_DIR: str(state_dir)},
        run_config={protocol.EXPERIMENT: json.dumps(fed.config.to_dict())},
    )  # fmt: skip


def _message(kind: str, content: dict) -> Message:
    metadata = Metadata(
        run_id=1, message_id=f"{kind}-1", src_node_id=1, dst_node_id=NODE_ID,
        reply_to_message_id="", group_id="", created_at=time.time(), ttl=3600.0,
        message_type=kind,
    )  # fmt: skip
    return Message(RecordDict(content), metadata=metadata)


def _round_message(fed: SimpleNamespace, kind: str, *, client: int = CLIENT, round_: int = 1,
                   arrays: dict | None = None, **extra: object) -> Message:  # fmt: skip
    """A train or evaluate message as the Flower server builds it (deploy.train_messages,
    deploy.evaluation)."""
    cfg = {protocol.ROUND: round_, protocol.WIRE: fed.wire, protocol.RUN: RUN,
           protocol.CLIENT: client}  # fmt: skip
    if kind == protocol.TRAIN:
        cfg.update({protocol.STATE_ROUND: round_ - 1, protocol.KEEP_FROM: 0})
    cfg.update(extra)
    arrays = fed.sent if arrays is None else arrays
    return _message(kind, {protocol.CONFIG: ConfigRecord(cfg),
                           protocol.GLOBAL: codec.to_record(arrays)})  # fmt: skip


def _files(state_dir: Path) -> list[str]:
    """What the node keeps of its clients (not its tokenised-pool cache)."""
    run = state_dir / RUN
    return sorted(str(p.relative_to(run)) for p in run.rglob("*.npz")) if run.is_dir() else []


def test_the_three_kinds_are_registered() -> None:
    """Fine-tuning's (the default action), further pre-training's (`*.pretrain`) and secure
    aggregation's three stages (queries)."""
    kinds = (protocol.QUERY, protocol.TRAIN, protocol.EVALUATE)
    stages = ("secagg_share", "secagg_mask", "secagg_unmask")
    assert set(client_app.app._registered_funcs) == {
        f"{kind}.{action}" for kind in kinds for action in ("default", protocol.PRETRAIN)
    } | {f"{protocol.QUERY}.{stage}" for stage in stages}


def test_a_query_reply_carries_the_client_id_and_its_split(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    msg = _message(protocol.QUERY, {})
    reply = client_app.app(msg, _context(fed, tmp_path))
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert reply.metadata.message_type == protocol.QUERY
    assert not reply.content.array_records  # indices and sizes only
    assert list(reply.content[protocol.CONFIG][protocol.CLIENTS]) == [CLIENT]
    cfg = reply.content[protocol.client_record(CLIENT)]
    split = fed.partition.clients[CLIENT]
    assert cfg[protocol.CLIENT] == CLIENT
    assert cfg[protocol.SPLIT_TRAIN] == [int(i) for i in split.train]
    assert cfg[protocol.SPLIT_TEST] == [int(i) for i in split.test]
    assert len(split.train) > 0 and len(split.test) > 0
    assert cfg[protocol.POOL_SIZE] == fed.pool_size
    shares = json.loads(str(cfg[protocol.SHARES]))
    assert shares is None or sum(shares) == pytest.approx(1.0)
    partition = json.loads(str(cfg[protocol.PARTITION]))
    assert partition["scheme"] == fed.config.data.partition and "clients" not in partition
    assert protocol.TAG_NAMES not in cfg  # sst2 has no tags
    other = client_app.app(msg, _context(fed, tmp_path, client=0)).content[
        protocol.client_record(0)]  # fmt: skip
    assert other[protocol.CLIENT] == 0
    assert other[protocol.SPLIT_TRAIN] == [int(i) for i in fed.partition.clients[0].train]


def test_a_node_of_several_clients_answers_for_each_and_trains_each_alone(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """partition-ids=0-2: the query reply has each client's own record, exactly what a node of
    that client alone replies; a train message for client 2 gives the upload a node of client 2
    alone gives; a client the node does not hold is refused."""
    many = _context(fed, tmp_path / "many")
    many.node_config.pop(protocol.PARTITION_ID)
    many.node_config[protocol.PARTITION_IDS] = "0-2"
    reply = client_app.app(_message(protocol.QUERY, {}), many).content
    assert list(reply[protocol.CONFIG][protocol.CLIENTS]) == [0, 1, 2]
    for c in range(3):
        alone = client_app.app(_message(protocol.QUERY, {}), _context(fed, tmp_path / f"a{c}", c))
        key = protocol.client_record(c)
        assert dict(reply[key]) == dict(alone.content[key])
    msg = _round_message(fed, protocol.TRAIN, client=2)
    got = codec.from_record(client_app.app(msg, many).content[protocol.UPLOAD])
    alone = _context(fed, tmp_path / "a2", 2)
    want = codec.from_record(client_app.app(msg, alone).content[protocol.UPLOAD])
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[k], x) and got[k].dtype == x.dtype for k, x in want.items())
    assert (tmp_path / "many" / RUN / "client_2").is_dir()
    few = _context(fed, tmp_path / "few")
    few.node_config.pop(protocol.PARTITION_ID)
    few.node_config[protocol.PARTITION_IDS] = "0-1"
    with pytest.raises(ValueError, match="message for client 2 reached 0,1"):
        client_app.app(_round_message(fed, protocol.TRAIN, client=2), few)


def test_a_partition_id_outside_the_clients_is_a_user_error(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="partition-id 3 is outside 0..2"):
        client_app.app(_message(protocol.QUERY, {}), _context(fed, tmp_path, client=3))


def test_a_train_reply_carries_only_the_trained_global_part_in_the_wire_dtype(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """The upload's bits are what deploy.node computes for this client; the new local part goes
    to the node's disk and nowhere else."""
    from fedjax_split.deploy import node as node_mod
    from fedjax_split.fed.roles import flatten_paths, select

    msg = _round_message(fed, protocol.TRAIN)
    reply = client_app.app(msg, _context(fed, tmp_path))
    assert reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert dict(reply.content[protocol.CONFIG]) == {protocol.CLIENT: CLIENT,
                                                    protocol.WIRE: "float16"}  # fmt: skip
    upload = codec.from_record(reply.content[protocol.UPLOAD])
    assert set(reply.content.array_records) == {protocol.UPLOAD}
    assert {p: a.shape for p, a in upload.items()} == {p: a.shape for p, a in fed.sent.items()}
    assert all(a.dtype == np.uint16 for a in upload.values())  # fp16 as its bits
    local_paths = set(flatten_paths(fed.local0))
    assert local_paths and not local_paths & set(upload)
    assert any(not np.array_equal(upload[p], fed.sent[p]) for p in upload)  # it trained
    m = reply.content[protocol.METRICS]
    assert m[protocol.NUM_TRAIN] == len(fed.partition.clients[CLIENT].train)
    assert m[protocol.STEPS] >= 1 and np.isfinite(m[protocol.LOSS_SUM])
    assert m[protocol.LOSS_UNITS] == m[protocol.NUM_TRAIN]  # one epoch over its examples
    assert _files(tmp_path) == [f"client_{CLIENT}/round_1.npz"]

    node = node_mod.prepare(fed.config, CLIENT)
    want, new_local, _, norm, _ = node_mod.train(node, codec.decode(fed.sent, fed.wire), 1, 0,
                                              node.local0)  # fmt: skip
    assert norm is None and protocol.UPDATE_NORM not in m  # no DP: nothing clipped or reported
    want_sent = codec.encode(select(want, None)[0], fed.wire)
    assert set(want_sent) == set(upload)
    for path, bits in want_sent.items():
        assert upload[path].tobytes() == bits.tobytes(), path
    stored = node_mod.local_part(node, node_mod.store(tmp_path, RUN, node), 1)
    for path, x in flatten_paths(new_local).items():
        np.testing.assert_array_equal(np.asarray(flatten_paths(stored)[path]), np.asarray(x))


def test_with_dp_the_node_clips_its_update_and_reports_its_norm(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """The round's clip norm comes down in the train message; what goes up is the node's update
    clipped to it (the simulation's `clip_one` of the unclipped upload), with the update's norm
    before clipping in the metrics. A clip norm that is not a positive number is refused before
    the node trains or stores anything."""
    import jax.numpy as jnp

    from fedjax_split.deploy import node as node_mod
    from fedjax_split.fed.client_program import client_functions
    from fedjax_split.fed.privacy import global_norm

    clip = 0.01
    reply = client_app.app(_round_message(fed, protocol.TRAIN, **{protocol.DP_CLIP: clip}),
                           _context(fed, tmp_path))  # fmt: skip
    upload = codec.decode(codec.from_record(reply.content[protocol.UPLOAD]), fed.wire)
    reported = reply.content[protocol.METRICS][protocol.UPDATE_NORM]

    node = node_mod.prepare(fed.config, CLIENT)
    received = codec.decode(fed.sent, fed.wire)
    unclipped, _, _, none, _ = node_mod.train(node, received, 1, 0, node.local0)
    assert none is None
    norm = float(global_norm(_minus(unclipped, received)))
    assert reported == pytest.approx(norm, rel=1e-6) and norm > clip  # it had to clip
    clip_one = client_functions(node.round_spec).clip_one
    want, _ = clip_one(unclipped, received, jnp.asarray(clip, jnp.float32))
    for path, bits in codec.encode(want, fed.wire).items():
        assert codec.encode(upload, fed.wire)[path].tobytes() == bits.tobytes(), path
    # on the fp16 wire the clipped update's norm is the clip norm up to the wire's rounding
    assert float(global_norm(_minus(upload, received))) <= clip * 1.01
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        fresh = tmp_path / f"bad{bad}"
        with pytest.raises(ValueError, match="DP clip norm"):
            client_app.app(_round_message(fed, protocol.TRAIN, **{protocol.DP_CLIP: bad}),
                           _context(fed, fresh))  # fmt: skip
        assert _files(fresh) == []


def _minus(a: dict, b: dict) -> dict:
    """a - b leaf by leaf, in fp32."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x, y: jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32),
                        a, b)  # fmt: skip


def test_a_schedules_subset_is_all_that_goes_up(fed: SimpleNamespace, tmp_path: Path) -> None:
    trained = sorted(p for p in fed.sent if p.startswith("encoder/layer_0/"))
    assert trained and len(trained) < len(fed.sent)
    reply = client_app.app(_round_message(fed, protocol.TRAIN, **{protocol.TRAINED: trained}),
                           _context(fed, tmp_path))  # fmt: skip
    assert sorted(codec.from_record(reply.content[protocol.UPLOAD])) == trained


def test_an_evaluate_reply_carries_the_clients_metrics_as_json(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """With the local part the node stored in round 1 (a node that never trained has the
    pretrained one)."""
    from fedjax_split.deploy import node as node_mod

    ctx = _context(fed, tmp_path)
    fresh = client_app.app(_round_message(fed, protocol.EVALUATE), ctx).content[protocol.CONFIG]
    client_app.app(_round_message(fed, protocol.TRAIN), ctx)
    reply = client_app.app(_round_message(fed, protocol.EVALUATE), ctx)
    assert not reply.content.array_records
    cfg = reply.content[protocol.CONFIG]
    assert cfg[protocol.CLIENT] == CLIENT
    metrics = json.loads(str(cfg[protocol.EVAL_JSON]))
    assert 0.0 <= metrics["accuracy"] <= 1.0
    node = node_mod.prepare(fed.config, CLIENT)
    local = node_mod.local_part(node, node_mod.store(tmp_path, RUN, node), 1)
    assert metrics == node_mod.evaluate(node, codec.decode(fed.sent, fed.wire), local)
    before = json.loads(str(fresh[protocol.EVAL_JSON]))
    assert before == node_mod.evaluate(node, codec.decode(fed.sent, fed.wire), node.local0)


def test_a_train_message_that_carries_the_evaluation_answers_both_as_two_messages_would(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """Round 2's train message carrying round 1's evaluation (one exchange): its reply holds the
    metrics round 1's evaluate message gives and the upload round 2's train message gives, bit
    for bit, and the node keeps the same files (the export's pair of round 1, round 2's part).
    A train message asking for another round's evaluation is refused."""
    from test_worker import _content

    replies = {}
    for way in ("two", "one"):
        ctx = _context(fed, tmp_path / way)
        client_app.app(_round_message(fed, protocol.TRAIN), ctx)
        train2 = {protocol.STATE_ROUND: 1, protocol.KEEP_FROM: 0}
        if way == "two":
            evaluated = client_app.app(_round_message(fed, protocol.EVALUATE), ctx)
            trained = client_app.app(_round_message(fed, protocol.TRAIN, round_=2, **train2), ctx)
            replies[way] = _content(trained)
            cfg, scores = f"config/{protocol.CONFIG}", _content(evaluated)
            assert list(scores) == [cfg]  # an evaluate reply: its config alone
            replies[way][cfg] = {**replies[way][cfg], **scores[cfg]}
        else:
            msg = _round_message(fed, protocol.TRAIN, round_=2, **train2,
                                 **{protocol.EVAL_ROUND: 1})  # fmt: skip
            replies[way] = _content(client_app.app(msg, ctx))
    assert replies["one"] == replies["two"]
    assert protocol.EVAL_JSON in replies["one"][f"config/{protocol.CONFIG}"]
    assert any(k.startswith(f"{protocol.UPLOAD}/") for k in replies["one"])
    assert _files(tmp_path / "one") == _files(tmp_path / "two")
    assert f"export/client_{CLIENT}_after_1.npz" in _files(tmp_path / "one")
    wrong = _round_message(fed, protocol.TRAIN, round_=2, **{protocol.STATE_ROUND: 1,
                           protocol.KEEP_FROM: 0, protocol.EVAL_ROUND: 0})  # fmt: skip
    with pytest.raises(ValueError, match="evaluate after round 0"):
        client_app.app(wrong, _context(fed, tmp_path / "one"))


def test_a_node_keeps_only_what_resume_and_export_need(
    fed: SimpleNamespace, tmp_path: Path
) -> None:
    """The pretrained local part (initial.npz) only when a kept checkpoint predates a client's
    first training (KEEP_FROM >= 1) or an evaluation used it; the export's local part is a
    second name of the store's version (one inode), not a copy; no frozen copy (this model has
    no frozen part)."""
    from fedjax_split.sim.client_store import load_tree

    for keep_from, wanted in ((0, False), (1, True)):
        state = tmp_path / f"keep_from_{keep_from}"
        extra = {protocol.STATE_ROUND: 1, protocol.KEEP_FROM: keep_from}
        msg = _round_message(fed, protocol.TRAIN, round_=2, **extra)
        client_app.app(msg, _context(fed, state))
        assert (state / RUN / "initial.npz").is_file() == wanted, keep_from
    kept = load_tree(tmp_path / "keep_from_1" / RUN / "initial.npz")
    for path, x in flatten_paths(fed.local0).items():
        np.testing.assert_array_equal(flatten_paths(kept)[path], np.asarray(x))
    state = tmp_path / "keep_from_0"
    client_app.app(_round_message(fed, protocol.EVALUATE, round_=2), _context(fed, state))
    run = state / RUN
    want = [f"client_{CLIENT}/round_2.npz", f"export/client_{CLIENT}_after_2.npz"]
    assert _files(state) == [*want, "export/global_after_2.npz"]
    stored = run / f"client_{CLIENT}" / "round_2.npz"
    exported = run / "export" / f"client_{CLIENT}_after_2.npz"
    assert stored.stat().st_ino == exported.stat().st_ino and stored.stat().st_nlink == 2
    other = _context(fed, state, client=2)  # an untrained client's evaluation needs the part
    client_app.app(_round_message(fed, protocol.EVALUATE, client=2, round_=2), other)
    assert (run / "initial.npz").is_file() and not (run / "frozen.npz").exists()


def _bad_globals(fed: SimpleNamespace) -> dict[str, tuple[dict, str]]:
    first = sorted(fed.sent)[0]
    missing = {p: a for p, a in fed.sent.items() if p != first}
    extra = {**fed.sent, "classifier/kernel": np.zeros((32, 2), np.uint16)}
    reshaped = {**fed.sent, first: fed.sent[first].reshape(-1)[:-1]}
    as_floats = {**fed.sent, first: fed.sent[first].view(np.float16)}
    return {
        "a missing path": (missing, "missing paths"),
        "a local path": (extra, "unexpected paths \\['classifier/kernel'\\]"),
        "a wrong shape": (reshaped, "has shape"),
        "fp16 not as bits": (as_floats, "arrived as float16, expected uint16"),
        "int32 for fp16": ({**fed.sent, first: fed.sent[first].astype(np.int32)},
                           "arrived as int32, expected uint16"),
    }


@pytest.mark.parametrize("kind", [protocol.TRAIN, protocol.EVALUATE])
def test_a_message_for_another_client_or_a_malformed_global_part_is_refused(
    fed: SimpleNamespace, tmp_path: Path, kind: str
) -> None:
    ctx = _context(fed, tmp_path)
    with pytest.raises(ValueError, match=f"message for client 2 reached {CLIENT}"):
        client_app.app(_round_message(fed, kind, client=2), ctx)
    for name, (arrays, why) in _bad_globals(fed).items():
        with pytest.raises(ValueError, match=why):
            client_app.app(_round_message(fed, kind, arrays=arrays), ctx)
        assert _files(tmp_path) == [], name  # refused before anything was stored
    with pytest.raises(ValueError, match="wire dtype float32; this run's is float16"):
        client_app.app(_round_message(fed, kind, **{protocol.WIRE: "float32"}), ctx)
    no_global = _round_message(fed, kind)
    del no_global.content[protocol.GLOBAL]
    with pytest.raises(KeyError):
        client_app.app(no_global, ctx)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_global_part_is_refused(
    fed: SimpleNamespace, tmp_path: Path, value: float
) -> None:
    first = sorted(fed.sent)[0]
    poisoned = fed.sent[first].view(np.float16).copy()
    poisoned.reshape(-1)[0] = value
    arrays = {**fed.sent, first: poisoned.view(np.uint16)}
    with pytest.raises(ValueError):
        client_app.app(_round_message(fed, protocol.TRAIN, arrays=arrays), _context(fed, tmp_path))
    assert _files(tmp_path) == []

